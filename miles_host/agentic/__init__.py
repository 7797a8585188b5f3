"""Agentic rollouts: OpenAI chat messages rendered with the checkpoint's chat template,
and tool-call parsers for the model families' tool-call formats.

Used by ``miles serve``'s OpenAI-compatible API and by rollout sessions, so a
request rendered by either turns into the same token ids.
"""

from miles_host.agentic.chat import ChatTemplateError, normalize_messages, render_chat, render_chat_text
from miles_host.agentic.tool_parsers import (
    TOOL_PARSERS,
    ToolCall,
    ToolParser,
    detect_tool_parser,
    forced_tool_calls,
    get_tool_parser,
    register_tool_parser,
)

__all__ = [
    "TOOL_PARSERS",
    "ChatTemplateError",
    "ToolCall",
    "ToolParser",
    "detect_tool_parser",
    "forced_tool_calls",
    "get_tool_parser",
    "normalize_messages",
    "register_tool_parser",
    "render_chat",
    "render_chat_text",
]
