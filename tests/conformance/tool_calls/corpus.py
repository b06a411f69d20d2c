"""A corpus of realistic agent tools (OpenAI function definitions) and jsonschema helpers.

Between them the schemas cover every argument type (string, integer, number, boolean), required and
optional properties, string and number enums, ``$ref``/``$defs``, recursive schemas (trees, comment
threads), nested objects and arrays of objects, nullables (``["string", "null"]`` and ``anyOf`` with
``{"type": "null"}``), numeric bounds, a few string length bounds (most strings unbounded), and
``additionalProperties: false``.
"""

from __future__ import annotations

import json
from functools import lru_cache
from typing import Any

from jsonschema import Draft202012Validator


def _tool(name: str, description: str, properties: dict[str, Any], required: list[str] | None = None,
          closed: bool = False, defs: dict[str, Any] | None = None) -> dict[str, Any]:
    parameters: dict[str, Any] = {"type": "object", "properties": properties}
    if required:
        parameters["required"] = required
    if closed:
        parameters["additionalProperties"] = False
    if defs:
        parameters["$defs"] = defs
    return {"type": "function", "function": {"name": name, "description": description, "parameters": parameters}}


S = {"type": "string"}
I = {"type": "integer"}  # noqa: E741
N = {"type": "number"}
B = {"type": "boolean"}


def _s(description: str, **extra: Any) -> dict[str, Any]:
    return {"type": "string", "description": description, **extra}


ADDRESS = {"type": "object", "properties": {"street": S, "city": S, "postal_code": S, "country": _s("ISO 3166 code")},
           "required": ["city", "country"], "additionalProperties": False}
PERSON = {"type": "object", "properties": {"name": S, "email": S, "optional": B}, "required": ["email"]}
TREE_NODE = {"type": "object", "properties": {"name": S, "size_bytes": {"type": "integer", "minimum": 0},
                                              "children": {"type": "array", "items": {"$ref": "#/$defs/node"}}},
             "required": ["name"], "additionalProperties": False}
COMMENT = {"type": "object", "properties": {"author": S, "body": S,
                                            "replies": {"type": "array", "items": {"$ref": "#/$defs/comment"}}},
           "required": ["author", "body"], "additionalProperties": False}

TOOLS: list[dict[str, Any]] = [
    _tool("get_weather", "Current weather for a city.",
          {"city": _s("City name"), "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
           "include_forecast": B, "days": {"type": "integer", "minimum": 1, "maximum": 14}},
          ["city"], closed=True),
    _tool("search_web", "Search the web.",
          {"query": _s("Search terms"), "num_results": {"type": "integer", "minimum": 1, "maximum": 50},
           "safe_search": B, "region": {"type": ["string", "null"]},
           "time_range": {"enum": ["day", "week", "month", "year", "any"]}},
          ["query"], closed=True),
    _tool("create_calendar_event", "Create a calendar event.",
          {"title": _s("Event title"), "start": _s("ISO 8601 start time"), "end": _s("ISO 8601 end time"),
           "attendees": {"type": "array", "items": {"$ref": "#/$defs/person"}},
           "location": {"anyOf": [{"$ref": "#/$defs/address"}, {"type": "null"}]},
           "reminder_minutes": {"enum": [0, 5, 10, 15, 30, 60]}, "all_day": B},
          ["title", "start"], closed=True, defs={"person": PERSON, "address": ADDRESS}),
    _tool("run_sql", "Run a read-only SQL query.",
          {"query": _s("SQL text"), "database": {"type": "string", "enum": ["analytics", "billing", "users"]},
           "timeout_s": {"type": "number", "minimum": 0.1, "maximum": 300},
           "params": {"type": "array", "items": {"type": ["string", "number", "boolean", "null"]}}},
          ["query", "database"], closed=True),
    _tool("send_email", "Send an email.",
          {"to": {"type": "array", "items": S, "minItems": 1}, "cc": {"type": "array", "items": S},
           "subject": _s("Subject line", maxLength=120), "body": _s("Plain-text body"),
           "priority": {"enum": ["low", "normal", "high"]}, "reply_to": {"type": ["string", "null"]}},
          ["to", "subject", "body"], closed=True),
    _tool("create_github_issue", "Open an issue on GitHub.",
          {"owner": S, "repo": S, "title": S, "body": {"type": ["string", "null"]},
           "labels": {"type": "array", "items": S}, "assignees": {"type": "array", "items": S},
           "milestone": {"anyOf": [{"type": "integer", "minimum": 1}, {"type": "null"}]}},
          ["owner", "repo", "title"], closed=True),
    _tool("book_flight", "Book a flight.",
          {"origin": _s("IATA code", minLength=3, maxLength=3),
           "destination": _s("IATA code", minLength=3, maxLength=3),
           "date": S, "return_date": {"type": ["string", "null"]},
           "passengers": {"type": "array", "minItems": 1, "items": {"$ref": "#/$defs/passenger"}},
           "cabin": {"enum": ["economy", "premium_economy", "business", "first"]}, "max_price_usd": N},
          ["origin", "destination", "date", "passengers"], closed=True,
          defs={"passenger": {"type": "object", "properties": {
              "first_name": S, "last_name": S, "age": {"type": "integer", "minimum": 0, "maximum": 120},
              "seat_preference": {"enum": ["window", "aisle", "none"]}},
              "required": ["first_name", "last_name"], "additionalProperties": False}}),
    _tool("edit_file", "Replace text in a file.",
          {"path": S, "old_text": S, "new_text": S, "replace_all": B},
          ["path", "old_text", "new_text"], closed=True),
    _tool("kubectl_apply", "Apply a Kubernetes manifest.",
          {"manifest": _s("YAML manifest"), "namespace": S, "dry_run": {"enum": ["none", "client", "server"]},
           "server_side": B, "timeout_s": {"type": "integer", "minimum": 1, "maximum": 600}},
          ["manifest"], closed=True),
    _tool("read_file", "Read a file.",
          {"path": S, "offset": {"type": "integer", "minimum": 0}, "limit": {"type": "integer", "minimum": 1}},
          ["path"], closed=True),
    _tool("write_file", "Write a file.", {"path": S, "content": S, "mode": {"enum": ["overwrite", "append"]}},
          ["path", "content"], closed=True),
    _tool("list_directory", "List a directory.",
          {"path": S, "recursive": B, "max_depth": {"type": ["integer", "null"], "minimum": 1, "maximum": 10},
           "include_hidden": B}, ["path"]),
    _tool("bash", "Run a shell command.",
          {"command": S, "timeout_ms": {"type": "integer", "minimum": 100, "maximum": 600000}, "cwd": S},
          ["command"], closed=True),
    _tool("git_commit", "Commit staged changes.",
          {"message": _s("Commit message", minLength=1, maxLength=72), "amend": B,
           "author": {"anyOf": [{"$ref": "#/$defs/person"}, {"type": "null"}]}},
          ["message"], closed=True, defs={"person": PERSON}),
    _tool("create_pull_request", "Open a pull request.",
          {"repo": S, "head": S, "base": S, "title": S, "body": S, "draft": B,
           "reviewers": {"type": "array", "items": S, "maxItems": 5}},
          ["repo", "head", "base", "title"], closed=True),
    _tool("query_logs", "Query service logs.",
          {"service": S, "level": {"enum": ["debug", "info", "warning", "error", "critical"]},
           "since_minutes": {"type": "integer", "minimum": 1, "maximum": 10080},
           "contains": {"type": ["string", "null"]},
           "limit": {"type": "integer", "minimum": 1, "maximum": 1000}}, ["service"], closed=True),
    _tool("get_stock_price", "Latest stock quote.",
          {"ticker": S, "exchange": {"enum": ["NYSE", "NASDAQ", "LSE", "TSE"]}, "include_after_hours": B},
          ["ticker"], closed=True),
    _tool("convert_currency", "Convert an amount between currencies.",
          {"amount": {"type": "number", "minimum": 0}, "from_currency": S, "to_currency": S,
           "rate_date": {"anyOf": [S, {"type": "null"}]}}, ["amount", "from_currency", "to_currency"], closed=True),
    _tool("translate_text", "Translate text.",
          {"text": S, "source_lang": {"type": ["string", "null"]}, "target_lang": S,
           "formality": {"enum": ["default", "more", "less"]}}, ["text", "target_lang"], closed=True),
    _tool("set_thermostat", "Set a smart thermostat.",
          {"device_id": S, "target_c": {"type": "number", "minimum": 5, "maximum": 35},
           "mode": {"enum": ["heat", "cool", "auto", "off"]}, "hold_hours": {"enum": [1, 2, 4, 8]}},
          ["device_id", "target_c"], closed=True),
    _tool("create_jira_ticket", "Create a Jira ticket.",
          {"project_key": S, "summary": S, "description": S,
           "issue_type": {"enum": ["Bug", "Task", "Story", "Epic"]},
           "priority": {"enum": ["Highest", "High", "Medium", "Low", "Lowest"]},
           "story_points": {"enum": [1, 2, 3, 5, 8, 13]}, "labels": {"type": "array", "items": S}},
          ["project_key", "summary", "issue_type"], closed=True),
    _tool("post_slack_message", "Post to a Slack channel.",
          {"channel": S, "text": S, "thread_ts": {"type": ["string", "null"]}, "unfurl_links": B,
           "blocks": {"type": "array", "items": {"type": "object", "properties": {
               "type": {"enum": ["section", "divider", "header"]}, "text": S}, "required": ["type"],
               "additionalProperties": False}}}, ["channel", "text"], closed=True),
    _tool("add_todo", "Add a to-do item.",
          {"title": S, "due": {"anyOf": [S, {"type": "null"}]},
           "priority": {"type": "integer", "minimum": 1, "maximum": 4},
           "tags": {"type": "array", "items": S}, "done": B}, ["title"], closed=True),
    _tool("create_file_tree", "Create a directory tree.",
          {"root": {"$ref": "#/$defs/node"}, "overwrite": B}, ["root"], closed=True, defs={"node": TREE_NODE}),
    _tool("post_comment_thread", "Post a nested comment thread.",
          {"post_id": S, "thread": {"$ref": "#/$defs/comment"}}, ["post_id", "thread"], closed=True,
          defs={"comment": COMMENT}),
    _tool("create_org_chart", "Record an org chart.",
          {"company": S, "ceo": {"$ref": "#/$defs/employee"}}, ["company", "ceo"], closed=True,
          defs={"employee": {"type": "object", "properties": {
              "name": S, "title": S,
              "reports": {"type": "array", "items": {"$ref": "#/$defs/employee"}, "maxItems": 3}},
              "required": ["name"], "additionalProperties": False}}),
    _tool("evaluate_expression", "Evaluate an arithmetic expression tree.",
          {"expr": {"$ref": "#/$defs/expr"}}, ["expr"], closed=True,
          defs={"expr": {"anyOf": [
              {"type": "number"},
              {"type": "object", "properties": {"op": {"enum": ["+", "-", "*", "/"]},
                                                "left": {"$ref": "#/$defs/expr"}, "right": {"$ref": "#/$defs/expr"}},
               "required": ["op", "left", "right"], "additionalProperties": False}]}}),
    _tool("get_directions", "Route between two places.",
          {"origin": S, "destination": S, "mode": {"enum": ["driving", "walking", "bicycling", "transit"]},
           "avoid": {"type": "array", "items": {"enum": ["tolls", "highways", "ferries"]}},
           "departure_time": {"type": ["string", "null"]}}, ["origin", "destination"], closed=True),
    _tool("search_products", "Search a product catalog.",
          {"query": S, "category": {"type": ["string", "null"]},
           "price": {"type": "object", "properties": {"min": {"type": "number", "minimum": 0},
                                                      "max": {"type": "number", "minimum": 0}},
                     "additionalProperties": False},
           "sort": {"enum": ["relevance", "price_asc", "price_desc", "rating"]}, "in_stock_only": B,
           "page": {"type": "integer", "minimum": 1}}, ["query"], closed=True),
    _tool("place_order", "Place an order.",
          {"customer_id": S,
           "items": {"type": "array", "minItems": 1, "items": {"type": "object", "properties": {
               "sku": S, "quantity": {"type": "integer", "minimum": 1, "maximum": 99},
               "gift_wrap": B}, "required": ["sku", "quantity"], "additionalProperties": False}},
           "shipping_address": {"$ref": "#/$defs/address"}, "coupon": {"type": ["string", "null"]}},
          ["customer_id", "items", "shipping_address"], closed=True, defs={"address": ADDRESS}),
    _tool("refund_payment", "Refund a payment.",
          {"payment_id": S, "amount_cents": {"type": "integer", "minimum": 1},
           "reason": {"enum": ["duplicate", "fraudulent", "requested_by_customer"]}, "notify_customer": B},
          ["payment_id", "reason"], closed=True),
    _tool("create_invoice", "Create an invoice.",
          {"customer": {"$ref": "#/$defs/party"}, "currency": {"enum": ["USD", "EUR", "GBP", "JPY"]},
           "lines": {"type": "array", "items": {"$ref": "#/$defs/line"}}, "due_days": {"enum": [7, 14, 30, 60]},
           "notes": {"anyOf": [S, {"type": "null"}]}},
          ["customer", "currency", "lines"], closed=True,
          defs={"party": {"type": "object", "properties": {"name": S, "tax_id": {"type": ["string", "null"]},
                                                           "address": {"$ref": "#/$defs/address"}},
                          "required": ["name"], "additionalProperties": False},
                "address": ADDRESS,
                "line": {"type": "object",
                         "properties": {"description": S, "quantity": {"type": "number", "minimum": 0},
                                                          "unit_price": {"type": "number", "minimum": 0},
                                                          "taxable": B},
                         "required": ["description", "quantity", "unit_price"], "additionalProperties": False}}),
    _tool("schedule_meeting", "Find a slot and schedule a meeting.",
          {"participants": {"type": "array", "items": S, "minItems": 2},
           "duration_minutes": {"enum": [15, 30, 45, 60, 90]}, "earliest": S, "latest": S,
           "timezone": S, "video_link": B}, ["participants", "duration_minutes"], closed=True),
    _tool("get_user_profile", "Look up a user.", {"user_id": S, "fields": {"type": "array", "items": {
        "enum": ["name", "email", "plan", "created_at", "last_login"]}}}, ["user_id"], closed=True),
    _tool("update_user_settings", "Update a user's settings.",
          {"user_id": S, "settings": {"type": "object", "properties": {
              "theme": {"enum": ["light", "dark", "system"]}, "language": S,
              "notifications": {"type": "object", "properties": {"email": B, "push": B, "sms": B},
                                "additionalProperties": False},
              "font_scale": {"type": "number", "minimum": 0.5, "maximum": 2.0}}, "additionalProperties": False}},
          ["user_id", "settings"], closed=True),
    _tool("resize_image", "Resize an image.",
          {"url": S, "width": {"type": "integer", "minimum": 1, "maximum": 8192},
           "height": {"type": "integer", "minimum": 1, "maximum": 8192}, "keep_aspect": B,
           "format": {"enum": ["png", "jpeg", "webp"]}, "quality": {"type": "integer", "minimum": 1, "maximum": 100}},
          ["url", "width"], closed=True),
    _tool("generate_image", "Generate an image from a prompt.",
          {"prompt": S, "negative_prompt": {"type": ["string", "null"]},
           "size": {"enum": ["256x256", "512x512", "1024x1024"]},
           "steps": {"type": "integer", "minimum": 1, "maximum": 150},
           "guidance": {"type": "number", "minimum": 0, "maximum": 20},
           "seed": {"anyOf": [{"type": "integer"}, {"type": "null"}]}}, ["prompt"], closed=True),
    _tool("transcribe_audio", "Transcribe an audio file.",
          {"audio_url": S, "language": {"type": ["string", "null"]}, "diarize": B,
           "max_speakers": {"type": "integer", "minimum": 1, "maximum": 10}}, ["audio_url"], closed=True),
    _tool("create_spreadsheet_rows", "Append rows to a spreadsheet.",
          {"spreadsheet_id": S, "sheet": S,
           "rows": {"type": "array",
                    "items": {"type": "array", "items": {"type": ["string", "number", "boolean", "null"]}}},
           "value_input": {"enum": ["RAW", "USER_ENTERED"]}}, ["spreadsheet_id", "rows"], closed=True),
    _tool("http_request", "Make an HTTP request.",
          {"method": {"enum": ["GET", "POST", "PUT", "PATCH", "DELETE"]}, "url": S,
           "headers": {"type": "array", "items": {"type": "object", "properties": {"name": S, "value": S},
                                                  "required": ["name", "value"], "additionalProperties": False}},
           "body": {"type": ["string", "null"]}, "timeout_s": {"type": "number", "minimum": 0, "maximum": 120},
           "follow_redirects": B}, ["method", "url"], closed=True),
    _tool("docker_run", "Run a container.",
          {"image": S, "command": {"type": "array", "items": S},
           "env": {"type": "array", "items": {"type": "object", "properties": {"key": S, "value": S},
                                              "required": ["key", "value"], "additionalProperties": False}},
           "ports": {"type": "array", "items": {"type": "object", "properties": {
               "host": {"type": "integer", "minimum": 1, "maximum": 65535},
               "container": {"type": "integer", "minimum": 1, "maximum": 65535},
               "protocol": {"enum": ["tcp", "udp"]}}, "required": ["host", "container"],
                                                "additionalProperties": False}},
           "detach": B, "memory_mb": {"type": ["integer", "null"], "minimum": 16}}, ["image"], closed=True),
    _tool("terraform_plan", "Run terraform plan.",
          {"workspace": S, "variables": {"type": "array", "items": {"type": "object", "properties": {
              "name": S, "value": S, "sensitive": B}, "required": ["name", "value"]}},
           "target": {"type": ["string", "null"]}, "refresh": B}, ["workspace"], closed=True),
    _tool("scale_deployment", "Scale a Kubernetes deployment.",
          {"deployment": S, "namespace": S, "replicas": {"type": "integer", "minimum": 0, "maximum": 100},
           "wait": B}, ["deployment", "replicas"], closed=True),
    _tool("create_alert_rule", "Create a monitoring alert.",
          {"name": S, "metric": S, "comparison": {"enum": [">", ">=", "<", "<=", "=="]}, "threshold": N,
           "window_minutes": {"enum": [1, 5, 15, 60]},
           "severity": {"enum": ["info", "warning", "critical"]},
           "notify": {"type": "array", "items": {"$ref": "#/$defs/channel"}}},
          ["name", "metric", "comparison", "threshold"], closed=True,
          defs={"channel": {"type": "object", "properties": {"kind": {"enum": ["email", "slack", "pagerduty"]},
                                                             "target": S}, "required": ["kind", "target"],
                            "additionalProperties": False}}),
    _tool("vector_search", "Similarity search in a vector store.",
          {"collection": S, "query_text": S, "top_k": {"type": "integer", "minimum": 1, "maximum": 100},
           "min_score": {"type": "number", "minimum": 0, "maximum": 1},
           "filter": {"anyOf": [{"type": "object", "properties": {"field": S, "equals": S},
                                 "required": ["field", "equals"], "additionalProperties": False}, {"type": "null"}]}},
          ["collection", "query_text"], closed=True),
    _tool("calculate_mortgage", "Monthly mortgage payment.",
          {"principal": {"type": "number", "minimum": 1000},
           "annual_rate_pct": {"type": "number", "minimum": 0, "maximum": 25},
           "years": {"enum": [10, 15, 20, 30]}, "down_payment": {"type": "number", "minimum": 0}},
          ["principal", "annual_rate_pct", "years"], closed=True),
    _tool("get_exchange_rates", "Exchange rates for a base currency.",
          {"base": S, "symbols": {"type": "array", "items": S}, "date": {"anyOf": [S, {"type": "null"}]}},
          ["base"]),
    _tool("find_restaurants", "Find restaurants nearby.",
          {"location": S, "cuisine": {"type": ["string", "null"]}, "price_level": {"enum": [1, 2, 3, 4]},
           "open_now": B, "min_rating": {"type": "number", "minimum": 1, "maximum": 5},
           "radius_m": {"type": "integer", "minimum": 100, "maximum": 50000}}, ["location"], closed=True),
    _tool("reserve_table", "Reserve a table.",
          {"restaurant_id": S, "party_size": {"type": "integer", "minimum": 1, "maximum": 20}, "time": S,
           "name": S, "phone": {"type": ["string", "null"]}, "special_requests": S},
          ["restaurant_id", "party_size", "time", "name"], closed=True),
    _tool("book_hotel", "Book a hotel room.",
          {"hotel_id": S, "check_in": S, "check_out": S,
           "guests": {"type": "object", "properties": {"adults": {"type": "integer", "minimum": 1, "maximum": 8},
                                                       "children": {"type": "integer", "minimum": 0, "maximum": 6}},
                      "required": ["adults"], "additionalProperties": False},
           "room_type": {"enum": ["single", "double", "suite"]}, "breakfast": B},
          ["hotel_id", "check_in", "check_out", "guests"], closed=True),
    _tool("track_package", "Track a parcel.",
          {"tracking_number": S, "carrier": {"enum": ["ups", "fedex", "dhl", "usps"]}},
          ["tracking_number"], closed=True),
    _tool("summarize_document", "Summarize a document.",
          {"document_id": S, "max_words": {"type": "integer", "minimum": 10, "maximum": 1000},
           "style": {"enum": ["bullets", "paragraph", "tldr"]}, "focus": {"type": "array", "items": S}},
          ["document_id"], closed=True),
    _tool("create_cron_job", "Schedule a recurring job.",
          {"name": S, "schedule": _s("cron expression"), "command": S, "enabled": B,
           "retries": {"type": "integer", "minimum": 0, "maximum": 5}, "timeout_s": {"type": ["number", "null"]}},
          ["name", "schedule", "command"], closed=True),
    _tool("log_workout", "Log a workout.",
          {"date": S, "exercises": {"type": "array", "items": {"type": "object", "properties": {
              "name": S, "sets": {"type": "integer", "minimum": 1}, "reps": {"type": "integer", "minimum": 1},
              "weight_kg": {"type": ["number", "null"], "minimum": 0}}, "required": ["name", "sets"],
              "additionalProperties": False}},
           "perceived_effort": {"type": "integer", "minimum": 1, "maximum": 10}}, ["date", "exercises"], closed=True),
    _tool("no_arguments_ping", "Health check with no arguments.", {}, closed=True),
    _tool("set_feature_flag", "Toggle a feature flag.",
          {"flag": S, "enabled": B, "rollout_pct": {"type": "number", "minimum": 0, "maximum": 100},
           "environments": {"type": "array", "items": {"enum": ["dev", "staging", "prod"]}}},
          ["flag", "enabled"], closed=True),
    _tool("geocode_address", "Coordinates of an address.",
          {"address": {"$ref": "#/$defs/address"}, "bounds": {"anyOf": [{"$ref": "#/$defs/box"}, {"type": "null"}]}},
          ["address"], closed=True,
          defs={"address": ADDRESS, "box": {"type": "object", "properties": {
              "south": {"type": "number", "minimum": -90, "maximum": 90},
              "west": {"type": "number", "minimum": -180, "maximum": 180},
              "north": {"type": "number", "minimum": -90, "maximum": 90},
              "east": {"type": "number", "minimum": -180, "maximum": 180}},
              "required": ["south", "west", "north", "east"], "additionalProperties": False}}),
]

# A schema whose enum and const hold characters that must survive unescaped (HTML-ish, quotes, unicode).
SPECIAL_VALUES = ['a<b & "c"', "café ☕ — naïve", "<tool_call>", "x'y\\z", "日本語 & <emoji> 🚀"]
SPECIAL_TOOL = _tool("set_label", "Set a label to one of fixed values.",
                     {"label": {"enum": SPECIAL_VALUES}, "marker": {"const": "</tool_call> & <b>\"q\"</b> ✓"}},
                     ["label", "marker"], closed=True)

BY_NAME: dict[str, dict[str, Any]] = {t["function"]["name"]: t for t in TOOLS + [SPECIAL_TOOL]}
assert len(BY_NAME) == len(TOOLS) + 1, "duplicate names in the corpus"


def schema_of(name: str) -> dict[str, Any]:
    return BY_NAME[name]["function"]["parameters"]


@lru_cache(maxsize=None)
def _validator(name: str) -> Draft202012Validator:
    schema = schema_of(name)
    Draft202012Validator.check_schema(schema)
    return Draft202012Validator(schema)


def argument_errors(name: str, arguments: str, tools: list[dict[str, Any]] | None = None) -> list[str]:
    """Why a call's arguments (the JSON string) are not valid for the declared tool ``name``; [] when valid.

    ``tools``: the request's declared tools (default: the corpus)."""
    declared = {t["function"]["name"]: t for t in tools} if tools is not None else BY_NAME
    if name not in declared:
        return [f"undeclared tool {name!r}"]
    try:
        value = json.loads(arguments)
    except ValueError as exc:
        return [f"arguments are not JSON ({exc}): {arguments!r}"]
    if tools is None:
        validator = _validator(name)
    else:
        validator = Draft202012Validator(declared[name]["function"].get("parameters") or {"type": "object"})
    return [f"{'/'.join(map(str, e.absolute_path)) or '<root>'}: {e.message}" for e in validator.iter_errors(value)]


def assert_valid_call(name: str, arguments: str, tools: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    errors = argument_errors(name, arguments, tools)
    assert not errors, f"{name}({arguments}): {errors}"
    return json.loads(arguments)
