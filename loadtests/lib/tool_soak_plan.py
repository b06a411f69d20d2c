"""The tool soak's requests, pure and seeded: request ``i`` of seed ``s`` is the same body on every run.

A request declares 1-4 tools drawn from the conformance corpus, each mutated by one kind of ``MUTATIONS``
(or left as it is), and draws tool_choice, parallel_tool_calls, streaming, max_tokens and sampling.
Every body stays within the edge's default caps (services/edge/README.md "Limits"): at most 128 tools and
512 KiB of them, schemas at most 32 levels deep, names ``^[a-zA-Z0-9_-]{1,64}$``, and the prompt leaves
max_tokens of room in the model's context (``Sizing``); the schemas are valid Draft 2020-12 (checked by
tests/e2e/test_tool_soak_smoke.py: the meta-schema check is too slow to run on each).
"""

from __future__ import annotations

import copy
import json
import random
from dataclasses import dataclass
from typing import Any, Callable

from tests.conformance.tool_calls.corpus import SPECIAL_TOOL, TOOLS

try:  # another corpus of non-ASCII tools, when it exists
    from tests.conformance.tool_calls.corpus_unicode import TOOLS as UNICODE_TOOLS  # type: ignore[import-not-found]
except ImportError:
    UNICODE_TOOLS = []

BASE_TOOLS: list[dict[str, Any]] = [*TOOLS, SPECIAL_TOOL, *UNICODE_TOOLS]
MAX_SCHEMA_DEPTH = 32  # the edge's --max-schema-depth
MAX_TOOLS_BYTES = 512 << 10
BUDGETS = (16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512)  # max_tokens, clipped to the run's range

TEXTS = ["날씨 예보 (서울)", "天气预报 北京", "東京都の天気", "🌦️ forecast 🚀", "👩‍💻 dev ✔︎ 👨‍👩‍👧",
         "طقس اليوم في القاهرة",
         "שלום עולם", "e\u0301te\u0301 cafe\u0301 n\u0303", "Ωmega ß Straße", "नमस्ते दुनिया", "ภาษาไทย",
         "\u202eRTL override\u202c", "zero\u200bwidth\u200djoin", "Ꙭ 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 𝟙𝟚𝟛", "«quotes» \"double\" 'single'"]
KEYS = ["도시", "城市", "都市名", "город", "مدينة", "עיר", "e\u0301tage", "emoji_🚀", "ключ_2", "名前"]
PROMPTS = ["Please use the tools to help me with my request.", "서울 날씨 알려줘. 도구를 써.",
           "帮我用工具查一下。", "ツールを使ってください 🙏", "استخدم الأدوات من فضلك",
           "Book it, then tell me. Thanks!"]
PATTERNS = ["^[A-Z]{3}$", "^[A-Z]{2}-[0-9]{2,4}$", "^[a-z0-9._-]+@[a-z0-9-]+\\.[a-z]{2,6}$",
            "^\\d{4}-\\d{2}-\\d{2}$", "^(GET|POST|PUT)$", "^[가-힣]{1,4}$", "^#[0-9a-fA-F]{6}$"]
TYPES = [{"type": "string"}, {"type": "integer"}, {"type": "number"}, {"type": "boolean"},
         {"type": "array", "items": {"type": "string"}}, {"type": "integer", "minimum": 0, "maximum": 9}]


@dataclass(frozen=True, slots=True)
class Plan:
    """One request: the SDK's ``create`` keywords and what it was made of."""

    index: int
    body: dict[str, Any]
    kinds: tuple[str, ...]  # the mutation of each declared tool ("none": as in the corpus)

    @property
    def tools(self) -> list[dict[str, Any]]:
        return self.body["tools"]

    @property
    def choice(self) -> str:
        choice = self.body["tool_choice"]
        return choice if isinstance(choice, str) else "named"

    @property
    def named(self) -> str | None:
        choice = self.body["tool_choice"]
        return None if isinstance(choice, str) else choice["function"]["name"]

    @property
    def parallel(self) -> bool:
        return self.body.get("parallel_tool_calls", True)

    @property
    def label(self) -> str:
        return f"{self.choice} {'streamed' if self.body.get('stream') else 'plain'}"

    def brief(self) -> dict[str, Any]:
        """The body as sent (it reproduces the request), its tools' JSON cut at 20,000 characters."""
        tools = json.dumps(self.tools, ensure_ascii=False)
        rest = {k: v for k, v in self.body.items() if k != "tools"}
        return {**rest, "tools": self.tools if len(tools) <= 20_000 else tools[:20_000] + "..."}


def depth(value: Any) -> int:
    """Levels of objects/arrays, as the edge counts them (a flat object is 1)."""
    children = value.values() if isinstance(value, dict) else value if isinstance(value, list) else None
    if children is None:
        return 0
    return 1 + max((depth(child) for child in children), default=0)


# ------------------------------------------------------------ mutations of one tool's parameters (in place)
def _properties(params: dict[str, Any]) -> dict[str, Any]:
    return params.setdefault("properties", {})


def _require(params: dict[str, Any], *names: str) -> None:
    required = params.setdefault("required", [])
    required.extend(name for name in names if name not in required)


def _strings_in(schema: Any, visit: Callable[[dict[str, Any]], None]) -> None:
    if isinstance(schema, dict):
        visit(schema)
        for value in schema.values():
            _strings_in(value, visit)
    elif isinstance(schema, list):
        for value in schema:
            _strings_in(value, visit)


def m_unicode(params: dict[str, Any], rng: random.Random) -> None:
    def visit(node: dict[str, Any]) -> None:
        if isinstance(node.get("description"), str):
            node["description"] = f"{node['description']} {rng.choice(TEXTS)}"
        if isinstance(node.get("enum"), list):
            node["enum"] = [f"{v}{rng.choice(TEXTS)}" if isinstance(v, str) and rng.random() < 0.5 else v
                            for v in node["enum"]]
    _strings_in(params, visit)
    _properties(params)[f"label_{rng.randrange(100)}"] = {"const": rng.choice(TEXTS), "description": rng.choice(TEXTS)}
    _properties(params)["note"] = {"type": "string", "description": rng.choice(TEXTS), "enum": rng.sample(TEXTS, 4)}


def m_keys(params: dict[str, Any], rng: random.Random) -> None:
    properties = _properties(params)
    renamed = {}
    for name in list(properties):
        renamed[name] = f"{name}_{rng.choice(KEYS)}" if rng.random() < 0.6 else name
    params["properties"] = {renamed[name]: schema for name, schema in properties.items()}
    if "required" in params:
        params["required"] = [renamed[name] for name in params["required"]]
    params["properties"][rng.choice(KEYS)] = {"type": "string", "description": rng.choice(TEXTS)}


def m_deep(params: dict[str, Any], rng: random.Random) -> None:
    defs = params.pop("$defs", None)  # $refs point at the root's $defs: they stay there
    inner = copy.deepcopy(params)
    for level in range(rng.randint(3, 14)):
        wrapped = {"type": "object", "properties": {f"level_{level}": inner}, "required": [f"level_{level}"],
                   "additionalProperties": False}
        if depth({**wrapped, "$defs": defs or {}}) > MAX_SCHEMA_DEPTH:
            break
        inner = wrapped
    params.clear()
    params.update(inner)
    if defs:
        params["$defs"] = defs


def m_wide(params: dict[str, Any], rng: random.Random) -> None:
    properties = _properties(params)
    added = [f"field_{n:02d}" for n in range(rng.randint(10, 40))]
    for name in added:
        properties[name] = copy.deepcopy(rng.choice(TYPES))
    _require(params, *rng.sample(added, rng.randint(0, 8)))


def m_enum(params: dict[str, Any], rng: random.Random) -> None:
    values: list[Any] = [f"value_{n:03d}" for n in range(rng.randint(20, 100))]
    values += [f"{t} {n}" for n, t in enumerate(rng.sample(TEXTS, 5))]
    rng.shuffle(values)
    _properties(params)["choice"] = {"enum": values, "description": "one of many"}
    _require(params, "choice")


def m_pattern(params: dict[str, Any], rng: random.Random) -> None:
    for n, pattern in enumerate(rng.sample(PATTERNS, rng.randint(1, 3))):
        _properties(params)[f"code_{n}"] = {"type": "string", "pattern": pattern}
        if rng.random() < 0.5:
            _require(params, f"code_{n}")


def m_bounds(params: dict[str, Any], rng: random.Random) -> None:
    low = rng.randint(-1000, 1000)
    properties = _properties(params)
    properties["count"] = {"type": "integer", "minimum": low, "maximum": low + rng.randint(0, 50)}
    properties["ratio"] = {"type": "number", "exclusiveMinimum": 0, "exclusiveMaximum": 1}
    properties["big"] = {"type": "integer", "minimum": 10 ** 12}
    properties["negative"] = {"type": "number", "maximum": -0.5}
    _require(params, "count", "ratio")


def m_nullable(params: dict[str, Any], rng: random.Random) -> None:
    for name, schema in list(_properties(params).items()):
        if isinstance(schema.get("type"), str) and schema["type"] != "null" and rng.random() < 0.7:
            if rng.random() < 0.5:
                schema["type"] = [schema["type"], "null"]
            else:
                _properties(params)[name] = {"anyOf": [schema, {"type": "null"}]}
    _properties(params)["maybe"] = {"anyOf": [{"type": "integer"}, {"type": "string"}, {"type": "null"}]}


def m_recursive(params: dict[str, Any], rng: random.Random) -> None:
    defs = params.setdefault("$defs", {})
    defs["soak_list"] = {"type": "object", "properties": {"value": {"type": "string"},
                                                           "next": {"anyOf": [{"$ref": "#/$defs/soak_list"},
                                                                              {"type": "null"}]}},
                         "required": ["value"], "additionalProperties": False}
    defs["soak_tree"] = {"type": "object", "properties": {"label": {"type": "string", "description": rng.choice(TEXTS)},
                                                           "kids": {"type": "array", "maxItems": 3,
                                                                    "items": {"$ref": "#/$defs/soak_tree"}}},
                         "required": ["label"], "additionalProperties": False}
    _properties(params)["chain"] = {"$ref": "#/$defs/soak_list"}
    _properties(params)["tree"] = {"$ref": "#/$defs/soak_tree"}
    if rng.random() < 0.5:
        _require(params, "chain")


def m_objects(params: dict[str, Any], rng: random.Random) -> None:
    item = {"type": "object", "properties": {"id": {"type": "integer", "minimum": 1}, "name": {"type": "string"},
                                             "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 3},
                                             "active": {"type": "boolean"}},
            "required": ["id", "name"], "additionalProperties": False}
    _properties(params)["soak_rows"] = {"type": "array", "items": item, "minItems": 1, "maxItems": rng.randint(1, 4)}
    _require(params, "soak_rows")


MUTATIONS: dict[str, Callable[[dict[str, Any], random.Random], None]] = {
    "unicode": m_unicode, "keys": m_keys, "deep": m_deep, "wide": m_wide, "enum": m_enum, "pattern": m_pattern,
    "bounds": m_bounds, "nullable": m_nullable, "recursive": m_recursive, "objects": m_objects}
KINDS = ["none", *MUTATIONS, "combo"]


def mutated(tool: dict[str, Any], kind: str, rng: random.Random, suffix: str) -> dict[str, Any]:
    """A copy of ``tool`` mutated by ``kind``, named ``<name>_<suffix>`` (unique within its request)."""
    tool = copy.deepcopy(tool)
    function = tool["function"]
    function["name"] = f"{function['name'][:50]}_{suffix}"
    params = function.setdefault("parameters", {"type": "object", "properties": {}})
    steps = rng.sample([k for k in MUTATIONS if k != "deep"], rng.randint(2, 3)) if kind == "combo" else \
        [] if kind == "none" else [kind]
    for step in steps:
        MUTATIONS[step](params, rng)
    if kind in ("unicode", "combo"):
        function["description"] = f"{function.get('description', '')} {rng.choice(TEXTS)}"
    assert depth(params) <= MAX_SCHEMA_DEPTH, (kind, depth(params))
    return tool


@dataclass(frozen=True, slots=True)
class Sizing:
    """How much prompt fits: the model's context and its tokenizer's count (default: one token per UTF-8 byte,
    what a byte-level BPE takes at worst). The edge refuses a prompt + max_tokens over the context."""

    context: int = 2048
    count_tokens: Callable[[str], int] = lambda text: len(text.encode())


PROMPT_OVERHEAD = 320  # tokens: the edge's tools block and how-to-call text, the chat template, the messages
DRAWS = 20  # tries at tools that fit before falling back to one corpus tool as it is


def _draw_tools(rng: random.Random, room: int, sizing: Sizing) -> tuple[tuple[str, ...], list[dict[str, Any]]]:
    """1-4 tools whose JSON fits ``room`` tokens: big mutations go with small budgets, and some not at all."""
    for _ in range(DRAWS):
        kinds = tuple(rng.choice(KINDS) for _ in range(rng.choice((1, 1, 2, 3, 4))))
        tools = [mutated(rng.choice(BASE_TOOLS), kind, rng, f"s{n}") for n, kind in enumerate(kinds)]
        if sizing.count_tokens(json.dumps(tools, ensure_ascii=False)) <= room:
            return kinds, tools
    return ("none",), [mutated(TOOLS[rng.randrange(len(TOOLS))], "none", rng, "s0")]


def plan_one(index: int, seed: int, budget: tuple[int, int], model: str, sizing: Sizing = Sizing()) -> Plan:
    rng = random.Random(seed * 1_000_003 + index)
    budgets = [b for b in BUDGETS if budget[0] <= b <= budget[1]] or [budget[1]]
    max_tokens = rng.choice(budgets)
    kinds, tools = _draw_tools(rng, sizing.context - max_tokens - PROMPT_OVERHEAD, sizing)
    assert len(json.dumps(tools).encode()) <= MAX_TOOLS_BYTES
    choice = rng.choices(["required", "auto", "named"], weights=[4, 3, 3])[0]
    body: dict[str, Any] = {
        "model": model, "tools": tools, "max_tokens": max_tokens, "seed": rng.randrange(2 ** 31),
        "temperature": rng.choice((0.0, 1.0)),
        "tool_choice": {"type": "function", "function": {"name": rng.choice(tools)["function"]["name"]}}
        if choice == "named" else choice,
        "messages": [{"role": "user", "content": rng.choice(PROMPTS)}],
    }
    if rng.random() < 0.3:
        body["messages"].insert(0, {"role": "system", "content": f"You are a helpful agent. {rng.choice(TEXTS)}"})
    parallel = rng.choice((True, False, None))
    if parallel is not None:
        body["parallel_tool_calls"] = parallel
    if rng.random() < 0.5:
        body["stream"] = True
        if rng.random() < 0.5:
            body["stream_options"] = {"include_usage": True}
    return Plan(index, body, kinds)


def plan_requests(n: int, seed: int, budget: tuple[int, int], model: str, sizing: Sizing = Sizing()) -> list[Plan]:
    return [plan_one(i, seed, budget, model, sizing) for i in range(n)]
