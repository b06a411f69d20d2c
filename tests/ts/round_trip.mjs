// One streamed round trip with each official TypeScript SDK against the mesh (tests/e2e/test_ts_sdks.py).
// (the Responses turn needs metering in the mesh: it stores the first response)
// ROOT: the edge's origin (http://host:port), KEY: an API key. Prints one JSON line of what each SDK saw.
import Anthropic from "@anthropic-ai/sdk";
import OpenAI from "openai";

const { ROOT, KEY } = process.env;
const messages = [{ role: "user", content: "The router looks at the prompt and finds a worker." }];

const anthropic = new Anthropic({ baseURL: ROOT, apiKey: KEY, maxRetries: 0 });
const stream = anthropic.messages.stream({ model: "tiny", max_tokens: 8, messages });
const events = [];
for await (const event of stream) events.push(event.type);
const message = await stream.finalMessage();

const openai = new OpenAI({ baseURL: `${ROOT}/v1`, apiKey: KEY, maxRetries: 0 });
const chunks = await openai.chat.completions.create({
  model: "tiny", max_tokens: 8, messages, stream: true, stream_options: { include_usage: true },
});
let text = "";
let usage = null;
for await (const chunk of chunks) {
  text += chunk.choices[0]?.delta?.content ?? "";
  usage = chunk.usage ?? usage;
}
// Responses: a stored first turn, then a streamed turn that continues it by previous_response_id
const first = await openai.responses.create({ model: "tiny", input: "My name is Ada.", max_output_tokens: 6 });
const turn = await openai.responses.create({
  model: "tiny", previous_response_id: first.id, input: "What is my name?", max_output_tokens: 5, stream: true,
});
const responseEvents = [];
let streamed = "";
let last = null;
for await (const event of turn) {
  responseEvents.push(event.type);
  if (event.type === "response.output_text.delta") streamed += event.delta;
  if (event.response) last = event.response;
}
console.log(JSON.stringify({
  anthropic: { events, text: message.content.map((b) => b.text).join(""), stop_reason: message.stop_reason,
               usage: message.usage },
  openai: { text, usage },
  responses: { first: { id: first.id, text: first.output_text, store: first.store }, events: responseEvents,
               text: streamed, id: last.id, previous_response_id: last.previous_response_id,
               status: last.status, store: last.store, usage: last.usage },
}));
