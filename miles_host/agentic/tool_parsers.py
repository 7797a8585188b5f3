"""Tool-call parsers: the tool calls a model wrote in its family's format -> OpenAI ``tool_calls``.

Each format is a :class:`ToolParser` record in :data:`TOOL_PARSERS`, keyed by the
name SGLang's ``--tool-call-parser`` uses for it:

- ``qwen25`` (aliases ``qwen``, ``hermes``): Qwen 2.5 / Qwen 3 and Hermes,
  ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``, one block per call;
- ``llama3``: Llama 3.1 / 3.2 / 3.3 JSON, ``{"name": ..., "parameters": {...}}``, the
  whole reply or after ``<|python_tag|>``, several calls separated by ``;``;
- ``deepseekv3`` (aliases ``deepseekv31``, ``deepseek``): DeepSeek V3 / R1
  ``<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\\n```json\\n{...}\\n```<｜tool▁call▁end｜>...``
  and the V3.1 form ``<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{...}<｜tool▁call▁end｜>``.

``parser.parse(text)`` returns ``(content, calls)``: the text with the calls taken out
(stripped), and :class:`ToolCall` records whose ``arguments`` is a JSON string, as
OpenAI sends it. A call whose JSON does not parse is left in the content (the model
wrote something that is not a call); nothing is invented. Plugins add formats with
:func:`register_tool_parser`; :func:`detect_tool_parser` picks one from the chat
template's markers, then from the HF ``model_type``.

A *forced* call (``tool_choice`` ``"required"`` or a named function) is not written
in the family's format: as vLLM and SGLang do, the reply is constrained to JSON by a
schema (:func:`forced_tool_calls`): a non-empty array of ``{"name", "parameters"}``
for ``"required"``, the function's arguments object for a named one.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping, Sequence


def new_tool_call_id() -> str:
    """An id in OpenAI's ``call_...`` form."""
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass(frozen=True)
class ToolCall:
    """One parsed call: the function's ``name`` and its ``arguments`` as a JSON string."""

    name: str
    arguments: str
    id: str = field(default_factory=new_tool_call_id)

    def to_openai(self, index: int | None = None) -> dict[str, Any]:
        """OpenAI's ``tool_calls`` entry (with ``index`` for a stream delta)."""
        entry: dict[str, Any] = {"id": self.id, "type": "function",
                                 "function": {"name": self.name, "arguments": self.arguments}}
        if index is not None:
            entry["index"] = index
        return entry


@dataclass(frozen=True)
class ToolParser:
    """One model family's tool-call format.

    ``markers``: text that starts a call anywhere in a reply; ``leading``: text that
    starts a call only at the (whitespace-stripped) start of a reply; both tell a
    streaming server when to stop streaming content. ``template_markers``: text whose
    presence in a chat template identifies the format; ``model_types``: HF
    ``config.model_type`` values whose default template writes it.
    """

    name: str
    parse: Callable[[str], tuple[str, list[ToolCall]]]
    markers: tuple[str, ...] = ()
    leading: tuple[str, ...] = ()
    template_markers: tuple[str, ...] = ()
    model_types: tuple[str, ...] = ()
    aliases: tuple[str, ...] = ()
    description: str = ""
    streams_content: bool = True

    def streamable_prefix(self, text: str) -> int:
        """How many characters of a partial reply are surely content (no call starts in them).

        Stops before the first marker, and holds back a tail that could be the start
        of one, so a streaming server never sends part of a call as content. A parser
        whose whole reply is the calls (``streams_content`` false) streams none.
        """
        stripped = text.lstrip()
        if not stripped or not self.streams_content:
            return 0
        if any(stripped.startswith(m) or m.startswith(stripped) for m in self.leading):
            return 0
        end = len(text)
        for marker in self.markers:
            found = text.find(marker)
            if found >= 0:
                end = min(end, found)
        for marker in self.markers:
            for size in range(min(len(marker) - 1, end), 0, -1):
                if text[end - size:end] == marker[:size]:
                    end -= size
                    break
        return end


#: name (and alias) -> parser
TOOL_PARSERS: dict[str, ToolParser] = {}


def register_tool_parser(parser: ToolParser) -> ToolParser:
    """Add ``parser`` under its name and aliases; a name already taken is a ``ValueError``."""
    names = (parser.name, *parser.aliases)
    taken = [n for n in names if n in TOOL_PARSERS and TOOL_PARSERS[n] is not parser]
    if taken:
        raise ValueError(f"tool parser name(s) {taken} are already registered (by {TOOL_PARSERS[taken[0]].name!r})")
    for name in names:
        TOOL_PARSERS[name] = parser
    return parser


def get_tool_parser(name: str) -> ToolParser:
    """The parser registered as ``name``; a ``ValueError`` listing the known ones otherwise."""
    try:
        return TOOL_PARSERS[name]
    except KeyError:
        raise ValueError(f"unknown tool-call parser {name!r}; known: {sorted(TOOL_PARSERS)}") from None


def _unique_parsers() -> Iterable[ToolParser]:
    seen = set()
    for parser in TOOL_PARSERS.values():
        if parser.name not in seen:
            seen.add(parser.name)
            yield parser


def detect_tool_parser(model_type: str | None = None, chat_template: str | None = None) -> ToolParser | None:
    """The format a model writes tool calls in: by its chat template's markers (the
    template is what taught the model the format), else by ``model_type``; None if unknown."""
    if chat_template:
        for parser in _unique_parsers():
            if any(marker in chat_template for marker in parser.template_markers):
                return parser
    if model_type:
        for parser in _unique_parsers():
            if model_type in parser.model_types:
                return parser
    return None


# ----------------------------------------------------------------------------
# shared pieces
# ----------------------------------------------------------------------------


def _call_from_json(obj: Any, argument_keys: tuple[str, ...]) -> ToolCall | None:
    """``{"name": str, <argument key>: object}`` -> a call; anything else -> None."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    arguments: Any = {}
    for key in argument_keys:
        if key in obj:
            arguments = obj[key]
            break
    if isinstance(arguments, str):  # some models write the arguments already encoded
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return None
    if not isinstance(arguments, dict):
        return None
    return ToolCall(name=obj["name"], arguments=json.dumps(arguments, ensure_ascii=False))


def _loads(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return None


def _join_content(pieces: list[str]) -> str:
    return "".join(pieces).strip()


# ----------------------------------------------------------------------------
# Qwen 2.5 / Qwen 3 / Hermes
# ----------------------------------------------------------------------------

_HERMES_BLOCK = re.compile(r"<tool_call>(.*?)(?:</tool_call>|\Z)", re.S)


def parse_hermes(text: str) -> tuple[str, list[ToolCall]]:
    """``<tool_call>{json}</tool_call>`` blocks (the last may be unterminated at the end of the reply)."""
    content, calls, last = [], [], 0
    for match in _HERMES_BLOCK.finditer(text):
        call = _call_from_json(_loads(match.group(1).strip()), ("arguments", "parameters"))
        if call is None:
            continue
        content.append(text[last:match.start()])
        calls.append(call)
        last = match.end()
    content.append(text[last:])
    return _join_content(content), calls


register_tool_parser(ToolParser(
    name="qwen25", parse=parse_hermes, markers=("<tool_call>",), template_markers=("<tool_call>",),
    model_types=("qwen2", "qwen2_moe", "qwen3", "qwen3_moe", "qwen3_next"), aliases=("qwen", "hermes"),
    description="Qwen 2.5 / Qwen 3 / Hermes: <tool_call>{\"name\", \"arguments\"}</tool_call>",
))


# ----------------------------------------------------------------------------
# Llama 3.x JSON
# ----------------------------------------------------------------------------

_PYTHON_TAG = "<|python_tag|>"


def _json_objects(text: str) -> list[Any] | None:
    """A run of JSON values separated by ``;`` / whitespace; None unless all of ``text`` is that."""
    decoder, values, position = json.JSONDecoder(), [], 0
    while True:
        while position < len(text) and (text[position].isspace() or text[position] == ";"):
            position += 1
        if position == len(text):
            return values
        try:
            value, position = decoder.raw_decode(text, position)
        except json.JSONDecodeError:
            return None
        values.append(value)


def parse_llama3(text: str) -> tuple[str, list[ToolCall]]:
    """Llama 3 JSON calls: the reply is the calls, or the calls follow ``<|python_tag|>``."""
    tag = text.find(_PYTHON_TAG)
    if tag >= 0:
        before, region = text[:tag], text[tag + len(_PYTHON_TAG):]
    elif text.lstrip().startswith("{"):
        before, region = "", text
    else:
        return text.strip(), []
    values = _json_objects(region)
    calls = [_call_from_json(v, ("parameters", "arguments")) for v in values or []]
    if not calls or any(c is None for c in calls):
        return text.strip(), []
    return before.strip(), calls


register_tool_parser(ToolParser(
    name="llama3", parse=parse_llama3, markers=(_PYTHON_TAG,), leading=("{",),
    template_markers=(_PYTHON_TAG,), model_types=("llama",),
    description="Llama 3.x: {\"name\", \"parameters\"} JSON, optionally after <|python_tag|>, ';'-separated",
))


# ----------------------------------------------------------------------------
# DeepSeek V3 / R1 / V3.1
# ----------------------------------------------------------------------------

_DS_CALLS_BEGIN = "<｜tool▁calls▁begin｜>"
_DS_CALL = re.compile(r"<｜tool▁call▁begin｜>(.*?)<｜tool▁sep｜>(.*?)(?:<｜tool▁call▁end｜>|\Z)", re.S)
_DS_V3_BODY = re.compile(r"\s*([^\s`]+)\s*```(?:json)?\s*(.*?)\s*```\s*\Z", re.S)


def _deepseek_call(head: str, body: str) -> ToolCall | None:
    head = head.strip()
    v3 = _DS_V3_BODY.match(body)
    if head == "function" and v3 is not None:  # V3: type, then name and a fenced JSON block
        return _call_from_json({"name": v3.group(1), "arguments": _loads(v3.group(2))}, ("arguments",))
    return _call_from_json({"name": head, "arguments": _loads(body.strip())}, ("arguments",))  # V3.1


def parse_deepseek(text: str) -> tuple[str, list[ToolCall]]:
    """DeepSeek's ``<｜tool▁call▁begin｜>...<｜tool▁sep｜>...<｜tool▁call▁end｜>`` calls (V3 and V3.1 forms)."""
    begin = text.find(_DS_CALLS_BEGIN)
    if begin < 0:
        return text.strip(), []
    region = text[begin + len(_DS_CALLS_BEGIN):]
    calls = [_deepseek_call(m.group(1), m.group(2)) for m in _DS_CALL.finditer(region)]
    if not calls or any(c is None for c in calls):
        return text.strip(), []
    return text[:begin].strip(), calls


register_tool_parser(ToolParser(
    name="deepseekv3", parse=parse_deepseek, markers=(_DS_CALLS_BEGIN,), template_markers=(_DS_CALLS_BEGIN,),
    model_types=("deepseek_v3", "deepseek_v32"), aliases=("deepseekv31", "deepseek"),
    description="DeepSeek V3 / R1 / V3.1: <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>...<｜tool▁call▁end｜>",
))


# ----------------------------------------------------------------------------
# forced calls: tool_choice "required" or a named function
# ----------------------------------------------------------------------------


def _function(tool: Mapping[str, Any]) -> Mapping[str, Any]:
    function = tool.get("function") if isinstance(tool, Mapping) else None
    if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
        raise ValueError("each tool must be {'type': 'function', 'function': {'name', 'parameters'}}")
    return function


def _parameters(function: Mapping[str, Any]) -> dict[str, Any]:
    return dict(function.get("parameters") or {"type": "object", "properties": {}})


def _parse_required(text: str) -> tuple[str, list[ToolCall]]:
    value = _loads(text.strip())
    calls = [_call_from_json(v, ("parameters", "arguments")) for v in value] if isinstance(value, list) else []
    if not calls or any(c is None for c in calls):
        return text.strip(), []
    return "", calls


def forced_tool_calls(tools: Sequence[Mapping[str, Any]], tool_choice: Any) -> tuple[ToolParser, dict[str, Any]]:
    """The parser and the JSON schema that force a call, for ``tool_choice`` ``"required"`` or
    ``{"type": "function", "function": {"name": ...}}``; a ``ValueError`` for a function not in ``tools``."""
    functions = [_function(tool) for tool in tools]
    if tool_choice == "required":
        schema = {"type": "array", "minItems": 1, "items": {"anyOf": [
            {"type": "object", "properties": {"name": {"type": "string", "enum": [f["name"]]}, "parameters": _parameters(f)},
             "required": ["name", "parameters"]} for f in functions]}}
        return ToolParser(name="required", parse=_parse_required, streams_content=False), schema
    name = tool_choice.get("function", {}).get("name") if isinstance(tool_choice, Mapping) else None
    chosen = [f for f in functions if f["name"] == name]
    if not chosen:
        raise ValueError(f"tool_choice names function {name!r}, which is not in tools {[f['name'] for f in functions]}")

    def parse_named(text: str) -> tuple[str, list[ToolCall]]:
        arguments = _loads(text.strip())
        if not isinstance(arguments, dict):
            return text.strip(), []
        return "", [ToolCall(name=name, arguments=json.dumps(arguments, ensure_ascii=False))]

    return ToolParser(name=f"function:{name}", parse=parse_named, streams_content=False), _parameters(chosen[0])
