"""OpenAI chat ``messages`` -> prompt token ids, through the checkpoint's chat template.

The template is the tokenizer's own (``tokenizer_config.json`` / ``chat_template.jinja``),
rendered by ``tokenizer.apply_chat_template``, so the prompt is the one the model was
trained on. Messages are first brought into the shape chat templates expect, as
SGLang's OpenAI server does:

- ``content`` given as a list of parts (``[{"type": "text", "text": ...}]``) is joined
  into one string; ``None`` content (an assistant turn that only calls tools) becomes "";
- an assistant's ``tool_calls[i].function.arguments`` arrive as a JSON *string* (OpenAI's
  wire form) and are handed to the template as a dict, which templates ``tojson``;
- ``tools`` are OpenAI tool records (``{"type": "function", "function": {...}}``).

``chat_template_kwargs`` (``enable_thinking``, ...) go to the template as variables.
"""

from __future__ import annotations

import json
from typing import Any, Mapping, Sequence

#: roles a chat message may have (OpenAI's, with ``developer`` as a system turn)
ROLES = ("system", "developer", "user", "assistant", "tool")


class ChatTemplateError(ValueError):
    """A chat request that cannot be rendered (no template, malformed messages, template error)."""


def _text_of(content: Any, where: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for index, part in enumerate(content):
            if isinstance(part, str):
                parts.append(part)
            elif isinstance(part, Mapping) and part.get("type") in ("text", "input_text") and isinstance(part.get("text"), str):
                parts.append(part["text"])
            else:
                kind = part.get("type") if isinstance(part, Mapping) else type(part).__name__
                raise ChatTemplateError(
                    f"{where}.content[{index}] is a {kind!r} part; only text parts are supported by this model"
                )
        return "".join(parts)
    raise ChatTemplateError(f"{where}.content must be a string, a list of text parts or null, got {type(content).__name__}")


def _tool_call_for_template(call: Any, where: str) -> dict[str, Any]:
    if not isinstance(call, Mapping) or not isinstance(call.get("function"), Mapping):
        raise ChatTemplateError(f"{where} must be {{'id', 'type': 'function', 'function': {{'name', 'arguments'}}}}")
    function = dict(call["function"])
    if not isinstance(function.get("name"), str):
        raise ChatTemplateError(f"{where}.function.name must be a string")
    arguments = function.get("arguments")
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError as error:
            raise ChatTemplateError(f"{where}.function.arguments is not valid JSON: {error}") from error
    function["arguments"] = arguments if arguments is not None else {}
    return {**dict(call), "type": call.get("type", "function"), "function": function}


def normalize_messages(messages: Sequence[Any]) -> list[dict[str, Any]]:
    """Messages in the shape chat templates expect (see the module docstring).

    Raises :class:`ChatTemplateError` naming the message and field that is wrong.
    """
    if not isinstance(messages, Sequence) or isinstance(messages, (str, bytes)) or not messages:
        raise ChatTemplateError("messages must be a non-empty list of {'role', 'content'} objects")
    out = []
    for index, message in enumerate(messages):
        where = f"messages[{index}]"
        if not isinstance(message, Mapping):
            raise ChatTemplateError(f"{where} must be an object with 'role' and 'content'")
        role = message.get("role")
        if role not in ROLES:
            raise ChatTemplateError(f"{where}.role must be one of {list(ROLES)}, got {role!r}")
        item = {key: value for key, value in message.items() if value is not None}
        item["content"] = _text_of(message.get("content"), where)
        if role == "developer":
            item["role"] = "system"
        calls = message.get("tool_calls")
        if calls:
            if role != "assistant":
                raise ChatTemplateError(f"{where} has tool_calls but role {role!r}; only assistant turns call tools")
            item["tool_calls"] = [_tool_call_for_template(c, f"{where}.tool_calls[{i}]") for i, c in enumerate(calls)]
        else:
            item.pop("tool_calls", None)
        out.append(item)
    return out


def _check_template(tokenizer: Any) -> None:
    if tokenizer is None:
        raise ChatTemplateError("the checkpoint has no tokenizer, so chat messages cannot be rendered: send token ids")
    if not getattr(tokenizer, "chat_template", None):
        name = getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__
        raise ChatTemplateError(
            f"the tokenizer of {name!r} has no chat template, so chat messages cannot be rendered: use a chat "
            "checkpoint (its tokenizer_config.json 'chat_template' or chat_template.jinja), or send a plain "
            "prompt to /v1/completions"
        )


def _apply(
    tokenizer: Any,
    messages: Sequence[Any],
    *,
    tokenize: bool,
    tools: Sequence[Mapping[str, Any]] | None,
    add_generation_prompt: bool,
    continue_final_message: bool,
    chat_template_kwargs: Mapping[str, Any] | None,
) -> Any:
    _check_template(tokenizer)
    normalized = normalize_messages(messages)
    kwargs = dict(chat_template_kwargs or {})
    clash = sorted(set(kwargs) & {"tools", "add_generation_prompt", "continue_final_message", "tokenize", "conversation"})
    if clash:
        raise ChatTemplateError(f"chat_template_kwargs may not set {clash}: they are request fields of their own")
    if add_generation_prompt and continue_final_message:
        raise ChatTemplateError("add_generation_prompt and continue_final_message cannot both be true")
    try:
        rendered = tokenizer.apply_chat_template(
            normalized, tools=list(tools) if tools else None, add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message, tokenize=tokenize, **({"return_dict": False} if tokenize else {}),
            **kwargs,
        )
    except ChatTemplateError:
        raise
    except Exception as error:  # noqa: BLE001 - jinja raises TemplateError, TypeError, ...; all are the request's fault
        raise ChatTemplateError(f"the chat template could not render these messages: {type(error).__name__}: {error}") from error
    return rendered


def render_chat(
    tokenizer: Any,
    messages: Sequence[Any],
    *,
    tools: Sequence[Mapping[str, Any]] | None = None,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    chat_template_kwargs: Mapping[str, Any] | None = None,
) -> list[int]:
    """The prompt token ids of ``messages`` under the tokenizer's chat template.

    ``add_generation_prompt`` appends the assistant header (the model's turn);
    ``continue_final_message`` leaves the last (assistant) message open instead.
    """
    rendered = _apply(
        tokenizer, messages, tokenize=True, tools=tools, add_generation_prompt=add_generation_prompt,
        continue_final_message=continue_final_message, chat_template_kwargs=chat_template_kwargs,
    )
    if isinstance(rendered, Mapping):  # tokenizers that ignore return_dict=False
        rendered = rendered["input_ids"]
    ids = list(rendered)
    if ids and isinstance(ids[0], list):  # a batch of one
        ids = ids[0]
    return [int(t) for t in ids]


def render_chat_text(
    tokenizer: Any,
    messages: Sequence[Any],
    *,
    tools: Sequence[Mapping[str, Any]] | None = None,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    chat_template_kwargs: Mapping[str, Any] | None = None,
) -> str:
    """The rendered prompt as text (what :func:`render_chat` tokenizes), for logs and checks."""
    return _apply(
        tokenizer, messages, tokenize=False, tools=tools, add_generation_prompt=add_generation_prompt,
        continue_final_message=continue_final_message, chat_template_kwargs=chat_template_kwargs,
    )
