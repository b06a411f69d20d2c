"""Tools whose descriptions, property names, enums, consts and patterns hold text beyond ASCII.

Scripts: Hangul, CJK (Chinese, Japanese kana and kanji), emoji (single code points, skin-tone modifiers, ZWJ
sequences, flags), right-to-left text (Arabic, Hebrew) and combining characters (NFC ``\\u00e9`` and NFD
``e\\u0301`` side by side: both must come back exactly as declared, never normalized).

Tool names stay ASCII: OpenAI allows only ``^[a-zA-Z0-9_-]{1,64}$`` (``BAD_NAMES`` must be refused).
"""

from __future__ import annotations

import json
from typing import Any

NFC_E = "\u00e9"  # é, one code point
NFD_E = "e\u0301"  # e + combining acute accent, two code points
FAMILY = "\U0001F468\u200d\U0001F469\u200d\U0001F467\u200d\U0001F466"  # four emoji joined by ZWJ
RAINBOW_FLAG = "\U0001F3F3\ufe0f\u200d\U0001F308"  # white flag, VS16, ZWJ, rainbow
FLAG_KR, FLAG_JP = "\U0001F1F0\U0001F1F7", "\U0001F1EF\U0001F1F5"  # regional indicator pairs
THUMBS_MEDIUM = "\U0001F44D\U0001F3FD"  # thumbs up + skin tone modifier

CITIES = ["서울", "부산", "대구", "東京", "北京市"]
LANGUAGES = ["한국어", "中文", "日本語", "עברית", "العربية"]
EMOJI = [FAMILY, RAINBOW_FLAG, FLAG_KR, FLAG_JP, THUMBS_MEDIUM, "🚀"]
GREETINGS = ["مرحبا", "שלום", "السلام عليكم", "שלום עולם 👋"]
ACCENTED = [f"caf{NFC_E}", f"caf{NFD_E}", NFC_E, NFD_E, "Zoe\u0308", "n\u0303o"]  # NFC and NFD as different values
HANGUL_NAME = "^[가-힣]{1,8}$"
HIRAGANA = "^[ぁ-ん]{1,6}$"
HAN = "^[\u4e00-\u9fff]{2,4}$"
DONE = "✅ 완료 — 終わり"
RTL_CONST = "\u202bעברית\u202c"  # with explicit embedding marks: kept as sent too


def _tool(name: str, description: str, properties: dict[str, Any], required: list[str]) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, "description": description, "parameters": {
        "type": "object", "properties": properties, "required": required, "additionalProperties": False}}}


TOOLS: list[dict[str, Any]] = [
    _tool("set_region", "지역과 언어를 설정합니다. 地域と言語を設定する。",
          {"도시": {"enum": CITIES, "description": "도시 이름"}, "언어": {"enum": LANGUAGES},
           "marker": {"const": DONE}},
          ["도시", "언어", "marker"]),
    _tool("react_with_emoji", "React to a message with an emoji 👍 (가족 👨‍👩‍👧‍👦, flags 🇰🇷).",
          {"emoji": {"enum": EMOJI}, "😀_count": {"type": "integer", "minimum": 1, "maximum": 3},
           "flags": {"type": "array", "items": {"enum": [FLAG_KR, FLAG_JP]}, "minItems": 1, "maxItems": 2}},
          ["emoji", "😀_count", "flags"]),
    _tool("greet_rtl", "ברכה בעברית או בערבית — تحية بالعربية.",
          {"تحية": {"enum": GREETINGS}, "כיוון": {"const": RTL_CONST}},
          ["تحية", "כיוון"]),
    _tool("spell_accented", f"Accented words as sent: caf{NFC_E} (NFC) and caf{NFD_E} (NFD) differ.",
          {"word": {"enum": ACCENTED}, f"caf{NFD_E}": {"const": f"caf{NFD_E}"},
           f"caf{NFC_E}": {"const": f"caf{NFC_E}"}},
          ["word", f"caf{NFD_E}", f"caf{NFC_E}"]),
    _tool("register_name", "이름을 등록합니다 (한글만). 名前を登録する。",
          {"이름": {"type": "string", "pattern": HANGUL_NAME}, "よみ": {"type": "string", "pattern": HIRAGANA},
           "漢字": {"type": "string", "pattern": HAN}},
          ["이름", "よみ", "漢字"]),
    _tool("write_note", "메모를 씁니다: 日本語、中文、한국어、العربية、עברית、emoji 🎉 e\u0301 — any text.",
          {"제목": {"type": "string", "description": "제목 (한국어)"}, "本文": {"type": "string"},
           "ملاحظة": {"type": ["string", "null"]}, "tags": {"type": "array", "items": {"type": "string"},
                                                          "maxItems": 2}},
          ["제목", "本文", "ملاحظة"]),
]
BY_NAME: dict[str, dict[str, Any]] = {t["function"]["name"]: t for t in TOOLS}
# The exact strings each tool may use (enum and const values), by tool: what must come back byte for byte.
LITERALS: dict[str, set[str]] = {}


def _literals(schema: Any, out: set[str]) -> None:
    if isinstance(schema, dict):
        for key in ("enum", "const"):
            values = schema.get(key)
            for value in values if isinstance(values, list) else [values]:
                if isinstance(value, str):
                    out.add(value)
        for value in schema.values():
            _literals(value, out)
    elif isinstance(schema, list):
        for value in schema:
            _literals(value, out)


for _t in TOOLS:
    _literals(_t["function"]["parameters"], LITERALS.setdefault(_t["function"]["name"], set()))

# Tool names OpenAI refuses (and so must the edge: 400 naming tools[i].function.name).
BAD_NAMES = ["날씨", "天気を調べる", "get_wéather", f"get_w{NFD_E}ather", "weather_🌦", "طقس", "ｇｅｔ",
             "f\u0663", "get_weather\n", "get\u200bweather"]


def strings_in(value: Any) -> list[str]:
    """Every string in a decoded JSON value: object keys and string values."""
    if isinstance(value, str):
        return [value]
    if isinstance(value, dict):
        return [s for k, v in value.items() for s in [k, *strings_in(v)]]
    if isinstance(value, list):
        return [s for v in value for s in strings_in(v)]
    return []


def raw_in(arguments: str, text: str) -> bool:
    """Whether ``text`` appears in the arguments JSON as raw characters (its JSON form, unicode unescaped)."""
    return json.dumps(text, ensure_ascii=False)[1:-1] in arguments
