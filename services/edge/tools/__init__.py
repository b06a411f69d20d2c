"""Tool calls and structured output on the edge: pure functions, no bus and no HTTP.

A chat request flows through four steps (each its own module):

1. ``validate`` -- ``validate_tools(tools, tool_choice, parallel_tool_calls) -> ToolSpec | None``,
   ``validate_response_format(response_format) -> ResponseFormat``, ``validate_tool_messages(messages)``.
   Problems raise ``ToolRequestError(message, param)`` (param like ``tools[2].function.name``), for an
   OpenAI-shaped 400.
2. ``render`` -- for chat templates without tool support: ``render_tools_system_prompt(tools, fmt)``,
   ``assistant_tool_calls_text(tool_calls, fmt)``, ``tool_result_text(content)``.
3. ``grammar`` -- ``build_constraint(fmt, tool_spec, response_format) -> Constraint | None``: ``kind`` and
   ``spec`` go into ``shared.schema.Structured(kind, spec)``; cached, so the same tools give the same spec
   object. ``build_response_constraint(response_format)`` for a response_format alone.
4. ``parser`` -- ``make_parser(fmt, tool_spec.tools, id_prefix)``; ``feed(text) -> list[Delta]`` per text
   delta, ``finish(finish_reason) -> (list[Delta], Result)``. Deltas (``ContentDelta`` /
   ``ToolCallDelta``, ``.to_openai()`` for a stream chunk) concatenate to the Result, so streamed and
   non-streamed answers match. Run it only when the ToolSpec's choice is not "none".

Formats (``fmt``, chosen per model in config): "hermes" (Hermes / Qwen: ``<tool_call>\\n{"name": ...,
"arguments": {...}}\\n</tool_call>``) and "glm" (GLM-4.5/4.7/5: ``<tool_call>name<arg_key>k</arg_key>
<arg_value>v</arg_value></tool_call>``). The detokenizer keeps the tags even where they are special tokens, as
GLM's are (``services/edge/tokenizer.py`` ``KEPT_TAGS``).
"""

from services.edge.tools.grammar import (
                                         JSON_SCHEMA_COMPILE_OPTIONS,
                                         TOOL_FORMATS,
                                         Constraint,
                                         ConstraintCache,
                                         build_constraint,
                                         build_response_constraint,
)
from services.edge.tools.parser import ContentDelta, Delta, Result, ToolCallDelta, ToolCallParser, make_parser
from services.edge.tools.render import assistant_tool_calls_text, render_tools_system_prompt, tool_result_text
from services.edge.tools.validate import (
                                         ResponseFormat,
                                         Tool,
                                         ToolLimits,
                                         ToolRequestError,
                                         ToolSpec,
                                         validate_response_format,
                                         validate_tool_messages,
                                         validate_tools,
)

__all__ = [
    "Constraint", "ConstraintCache", "JSON_SCHEMA_COMPILE_OPTIONS", "TOOL_FORMATS", "build_constraint",
    "build_response_constraint", "ContentDelta", "Delta", "Result", "ToolCallDelta", "ToolCallParser",
    "make_parser", "assistant_tool_calls_text", "render_tools_system_prompt", "tool_result_text",
    "ResponseFormat", "Tool", "ToolLimits", "ToolRequestError", "ToolSpec", "validate_response_format",
    "validate_tool_messages", "validate_tools",
]
