"""The calculator agent: an ordinary tool-calling loop with the official ``openai`` client.

``miles run --custom-generate-function-path agent.generate --use-session-server`` calls
:func:`generate` for every trajectory; the loop talks to the trajectory's session URL
(``sample.metadata["session_url"]``) exactly as it would to any OpenAI-compatible server.
miles records the token ids the engine sampled in every turn, so the training sample is
what the model generated (tool output and template tokens not trained). :func:`reward`
scores the agent's final answer.
"""

from __future__ import annotations

import json

from task import CALCULATOR_TOOL, calculator

#: model turns per trajectory: a tool call, then the answer
MAX_TURNS = 3


def run_agent(client, question: str, tools: list[dict]) -> tuple[str | None, list[dict]]:
    """Ask ``question``, run the tool calls the model makes, and return its final answer
    (None if it never gave one) and the conversation."""
    messages = [{"role": "user", "content": question}]
    for _ in range(MAX_TURNS):
        reply = client.chat.completions.create(model="policy", messages=messages, tools=tools)
        message = reply.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if not message.tool_calls:
            return (message.content or "").strip(), messages
        for call in message.tool_calls:
            try:
                expression = json.loads(call.function.arguments).get("expression", "")
            except (json.JSONDecodeError, AttributeError):
                expression = call.function.arguments
            result = calculator(str(expression)) if call.function.name == "calculator" else "error: unknown tool"
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    return None, messages


def generate(args, sample, sampling_params, session):
    """The custom generate function: the agent against this trajectory's session URL."""
    from openai import OpenAI

    client = OpenAI(base_url=sample.metadata["session_url"], api_key="unused", max_retries=0)
    answer, messages = run_agent(client, sample.prompt, sample.metadata.get("tools") or [CALCULATOR_TOOL])
    sample.metadata["answer"] = answer
    sample.metadata["tool_calls"] = sum(len(m.get("tool_calls", [])) for m in messages)


def reward(sample, config=None) -> float:
    """1 when the agent's final answer is the label, else 0."""
    return float(sample.metadata.get("answer") == str(sample.label))
