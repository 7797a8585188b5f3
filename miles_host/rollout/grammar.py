"""Constrained decoding (SGLang's ``json_schema``, ``regex``, ``ebnf``, ``structural_tag``)
through xgrammar, as SGLang's default grammar backend does.

Each sample of a constrained request holds a :class:`RequestGrammar` (an xgrammar
matcher); before a step the rows' allowed-token masks become one boolean ``[B, V]``
tensor (:func:`allowed_tokens`), which :class:`~miles_host.rollout.penalties.LogitsProcessing`
applies (disallowed logits ``-inf``); after it each sampled token advances its matcher.
When the grammar is complete (its stop token accepted) the sample stops, with
``finish_reason`` ``{"type": "stop", "matched": <last token>}`` as in SGLang.

xgrammar is optional: without it a constrained request is a ``ValueError`` that says
what to install. Tensor legend: B = rows, V = vocabulary, W = 32-bit words of a bitmask.
"""

from __future__ import annotations

import json
from typing import Any

import torch


#: the ``json_schema`` value SGLang reads as "any JSON"
ANY_JSON = "$$ANY$$"


def _xgrammar(key: str):
    try:
        import xgrammar
    except ImportError:
        raise ValueError(
            f"constrained decoding (`{key}`) needs xgrammar: pip install xgrammar (or miles[grammar])"
        ) from None
    return xgrammar


class GrammarCompiler:
    """Compiles a request's grammar for one tokenizer and vocabulary (compiled grammars are cached)."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: tuple[int, ...]):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_token_ids = list(stop_token_ids)
        self._compiler = None
        self._cache: dict[tuple[str, str], Any] = {}

    def compile(self, key: str, spec: str) -> Any:
        """The compiled grammar of ``sampling_params[key] == spec``; ``ValueError`` if it is invalid."""
        xgr = _xgrammar(key)
        if self.tokenizer is None:
            raise ValueError(f"constrained decoding (`{key}`) needs a tokenizer: pass tokenizer= to the engine")
        if (key, spec) in self._cache:
            return self._cache[(key, spec)]
        if self._compiler is None:
            info = xgr.TokenizerInfo.from_huggingface(
                self.tokenizer, vocab_size=self.vocab_size, stop_token_ids=self.stop_token_ids or None
            )
            self._compiler = xgr.GrammarCompiler(info, max_threads=1)
        try:
            compiled = _COMPILE[key](self._compiler, spec)
        except (RuntimeError, ValueError, TypeError, KeyError, json.JSONDecodeError) as error:
            raise ValueError(f"invalid sampling_params: {key} could not be compiled: {error}") from None
        self._cache[(key, spec)] = compiled
        return compiled


def _json_schema(compiler, spec: str):
    """A JSON schema, or SGLang's ``"$$ANY$$"``: any JSON value (OpenAI's ``json_object``)."""
    if spec == ANY_JSON:
        return compiler.compile_builtin_json_grammar()
    json.loads(spec)  # a clear JSONDecodeError before xgrammar's
    return compiler.compile_json_schema(spec)


def _structural_tag(compiler, spec: str):
    """xgrammar's structural tag JSON, or SGLang's legacy ``{"structures": [{"begin", "schema",
    "end"}], "triggers": [...]}`` form (converted as SGLang converts it)."""
    import xgrammar

    tag = json.loads(spec)
    if isinstance(tag, dict) and "structures" in tag and "triggers" in tag and "format" not in tag:
        items = [
            xgrammar.StructuralTagItem(begin=s["begin"], schema=json.dumps(s["schema"]), end=s["end"])
            for s in tag["structures"]
        ]
        legacy = xgrammar.StructuralTag.from_legacy_structural_tag(items, tag["triggers"])
        legacy.format.at_least_one = bool(tag.get("at_least_one", False))
        return compiler.compile_structural_tag(legacy)
    return compiler.compile_structural_tag(spec)


#: how each grammar key compiles (SGLang's ``XGrammarGrammarBackend.dispatch_*``)
_COMPILE = {
    "json_schema": _json_schema,
    "regex": lambda compiler, spec: compiler.compile_regex(spec),
    "ebnf": lambda compiler, spec: compiler.compile_grammar(spec),
    "structural_tag": _structural_tag,
}


class RequestGrammar:
    """One sample's matcher: what it may sample next, and the tokens it took."""

    def __init__(self, compiled: Any):
        import xgrammar

        self._xgr = xgrammar
        self.matcher = xgrammar.GrammarMatcher(compiled)
        self.vocab_size = compiled.tokenizer_info.vocab_size

    def fill(self, bitmask_BW: torch.Tensor, row: int) -> None:
        """Write the allowed next tokens into row ``row`` of an xgrammar bitmask."""
        self.matcher.fill_next_token_bitmask(bitmask_BW, row)

    def accept(self, token: int) -> None:
        """Advance past a sampled token. One the grammar rejects (possible only when nothing it
        allows could be sampled: ``min_new_tokens`` holding back the stop token of a complete
        grammar) is recorded in ``rejected`` and the sample stops (:mod:`.stopping`)."""
        if not self.matcher.is_terminated() and not self.matcher.accept_token(token):
            self.rejected = token

    rejected: int | None = None

    @property
    def is_terminated(self) -> bool:
        return self.matcher.is_terminated()


def allowed_tokens(grammars: list[RequestGrammar | None], vocab_size: int, device: torch.device) -> torch.Tensor | None:
    """Boolean ``[B, V]``: what each row may sample (all for rows without a grammar); None if no row has one."""
    if all(g is None for g in grammars):
        return None
    import xgrammar

    bitmask_BW = xgrammar.allocate_token_bitmask(len(grammars), vocab_size)  # all allowed
    for row, grammar in enumerate(grammars):
        if grammar is not None and not grammar.is_terminated:
            grammar.fill(bitmask_BW, row)
    # the packed mask travels (V / 32 words a row) and is unpacked on the device
    bitmask_BW = bitmask_BW.to(device)
    bits_BW32 = (bitmask_BW[:, :, None] >> torch.arange(32, dtype=torch.int32, device=device)) & 1
    return bits_BW32.reshape(len(grammars), -1)[:, :vocab_size].bool()
