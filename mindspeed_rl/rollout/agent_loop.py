"""Multi-turn rollouts with tools (MindSpeed-RL's ReTool): the agent loop of one rank.

Every trajectory of the rank advances together, one batched generation per turn:

1. generate until the model ends its turn (or the token budget ends);
2. parse the turn's tool calls (``rl_config.tool_parser_format``, hermes:
   ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``);
3. run at most ``max_parallel_calls`` of them per trajectory, every trajectory's calls
   at once in the tool pool (``mindspeed_rl.agent_tools``);
4. append the tool responses as tool messages through the model's chat template
   (:class:`ToolTurnTemplate`) and continue; a trajectory without calls, out of calls
   (``max_tool_calls``) or out of tokens (``max_total_response_length``) leaves the batch.

With ``rl_config.async_engine`` (:func:`run_agent_loop_stepwise`) there are no batch-wide
turns: each trajectory's next turn joins the engine's running batch as soon as its own
tool calls are back.

The trajectory is kept as token ids: the model's own tokens are appended exactly as the
engine sampled them (never decoded and re-encoded), the template glue and the tool
responses are encoded once, so the prompt + response the trainer sees is exactly what
the engine saw. ``mask`` is 1 on the model's tokens and 0 on the rest; the rollout
log-probs of the other tokens are 0 (they are not the policy's samples).
"""

from __future__ import annotations

import time
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass, field
from typing import Callable, Sequence

from mindspeed_rl.agent_tools.parser import ParseResult, truncate
from mindspeed_rl.algorithms.routing import carry_routing

_MARK = "\u2063MSRL-CONTENT\u2063"  # a probe message's content: found back in the rendered text


class TemplateError(ValueError):
    """A chat template that cannot carry a multi-turn trajectory token-exactly."""


class ToolTurnTemplate:
    """The token ids that follow a model turn that called tools.

    Rendered by the tokenizer's chat template on a probe conversation: the template's
    glue after the model's end-of-turn token (e.g. ChatML's ``\\n`` after
    ``<|im_end|>``), the tool responses as ``tool`` messages (however the template
    writes them: Qwen2.5 wraps them in ``<tool_response>`` inside a user turn), and the
    next assistant generation prompt. The template must be prefix-stable: appending the
    tool messages must not re-render the turns before them.
    """

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self._closed = self._render(self._probe(), add_generation_prompt=False)
        after = self._closed[self._closed.rindex(_MARK) + len(_MARK):]
        self.turn_end = after  # what the template writes after an assistant message
        eos = tokenizer.decode([tokenizer.eos_token_id]) if tokenizer.eos_token_id is not None \
            else None
        # The model's turn ends with its EOS token; what the template writes after it is glue.
        self.glue = after[len(eos):] if eos and after.startswith(eos) else after
        self._check_prefix_stable()

    @staticmethod
    def _probe() -> list[dict]:
        return [{"role": "user", "content": "q"}, {"role": "assistant", "content": _MARK}]

    def _render(self, messages: list[dict], add_generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(messages, tokenize=False,
                                                  add_generation_prompt=add_generation_prompt)

    def _check_prefix_stable(self) -> None:
        name = getattr(self.tokenizer, "name_or_path", "") or type(self.tokenizer).__name__
        try:
            full = self._render(self._probe() + [{"role": "tool", "content": "r"}], True)
        except Exception as exc:  # noqa: BLE001 - jinja's errors, re-raised with the cause
            raise TemplateError(f"the chat template of {name} cannot render a tool message "
                                f"({type(exc).__name__}: {exc}); multi-turn needs a template "
                                "with a 'tool' role (ChatML, Qwen2.5)") from exc
        if not full.startswith(self._closed):
            raise TemplateError(
                f"the chat template of {name} re-renders the earlier turns when a tool message "
                "follows (the conversation is not a prefix of its continuation), so the tokens "
                "the model saw could not be the tokens the trainer sees; use a tokenizer whose "
                "template appends turns (ChatML, Qwen2.5)")

    def text(self, responses: Sequence[str], ended_with_eos: bool = True) -> str:
        """The text after a model turn: the template's end of the turn (only the glue when
        the model's last token was its EOS), the tool responses, the next generation
        prompt."""
        full = self._render(self._probe() + [{"role": "tool", "content": r} for r in responses],
                            add_generation_prompt=True)
        return (self.glue if ended_with_eos else self.turn_end) + full[len(self._closed):]

    def ids(self, responses: Sequence[str], ended_with_eos: bool = True) -> list[int]:
        return list(self.tokenizer.encode(self.text(responses, ended_with_eos),
                                          add_special_tokens=False))


@dataclass
class Trajectory:
    """One sample's conversation after its prompt, as token ids."""

    prompt: list[int]
    seed: int
    tokens: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)       # 1: the model's token
    logprobs: list[float] = field(default_factory=list)  # 0 on tool / template tokens
    turns: int = 0
    tool_calls: int = 0
    tool_errors: int = 0
    tool_timeouts: int = 0
    finish_reason: str = "stop"  # of its last model turn, or "length" at the token budget
    done: bool = False
    # Partial rollout: the model tokens this trajectory may still generate in this pass
    # (None: no pass budget); a trajectory out of it is ``paused``, not done, and resumes in
    # a later pass, inside its unfinished model turn when ``open_turn`` >= 0 (that turn's
    # first token in ``tokens``).
    pass_left: int | None = None
    paused: bool = False
    open_turn: int = -1
    # Routing replay R3: [prompt + tokens fed, MoE layers, k], the experts of every token the
    # engine fed, each from the pass that first fed it (algorithms/routing.py)
    routing: "torch.Tensor | None" = None

    @property
    def model_tokens(self) -> int:
        return sum(self.mask)

    def add_model_turn(self, token_ids: Sequence[int], logprobs: Sequence[float],
                       routing=None) -> int:
        """Append model tokens: a new turn, or more of the open one; returns the turn's
        first token. ``routing``: the engine's routes of this request (prompt + tokens so
        far, then the new ones), carried after the earlier ones."""
        if routing is not None:
            self.routing = routing if self.routing is None else \
                carry_routing(self.routing, routing)
        start = self.open_turn if self.open_turn >= 0 else len(self.tokens)
        if self.open_turn < 0:
            self.turns += 1
        self.tokens += list(token_ids)
        self.mask += [1] * len(token_ids)
        self.logprobs += list(logprobs)
        if self.pass_left is not None:
            self.pass_left -= len(token_ids)
        self.open_turn = -1
        return start

    def add_tool_turn(self, token_ids: Sequence[int]) -> None:
        self.tokens += list(token_ids)
        self.mask += [0] * len(token_ids)
        self.logprobs += [0.0] * len(token_ids)


@dataclass(frozen=True)
class AgentLimits:
    """The ``rl_config`` keys of the loop."""

    max_tool_calls: int
    max_parallel_calls: int
    max_total_response_length: int
    max_tool_response_length: int
    tool_response_truncate_side: str

    @classmethod
    def from_config(cls, rl, max_tokens: int) -> "AgentLimits":
        return cls(rl.max_tool_calls, rl.max_parallel_calls,
                   rl.max_total_response_length or max_tokens, rl.max_tool_response_length,
                   rl.tool_response_truncate_side)


@dataclass
class TurnStats:
    """What the loop did, for the rollout phase's metrics."""

    tool_seconds: float = 0.0


def run_agent_loop(generate, trajectories: list[Trajectory], *, pool, template: ToolTurnTemplate,
                   parse: Callable[[str], ParseResult], limits: AgentLimits, decode,
                   max_tokens: int, eos_token_id: int | None) -> TurnStats:
    """Advance ``trajectories`` (each with its prompt) until every one is done, turn by turn.

    ``generate(prompts, seeds, budgets)`` runs one batched turn (token ids in; per prompt
    a completion with ``token_ids``, ``logprobs``, ``finish_reason``); ``pool.run``
    runs tool calls; ``decode`` turns a model turn's ids into the text the parser reads.
    """
    stats = TurnStats()
    while True:
        active = [t for t in trajectories if not t.done and not t.paused]
        if not active:
            return stats
        completions = generate([t.prompt + t.tokens for t in active],
                               [_turn_seed(t) for t in active],
                               [_turn_budget(t, limits, max_tokens) for t in active])
        pending = [(t, parsed) for t, c in zip(active, completions)
                   if (parsed := _model_turn(t, c, limits, parse, decode, max_tokens))
                   is not None]
        if not pending:
            continue
        started = time.monotonic()
        calls = [(k, call) for k, (t, parsed) in enumerate(pending)
                 for call in _calls_to_run(t, parsed, limits)]
        results: list[list] = [[] for _ in pending]
        for (k, _), result in zip(calls, pool.run(calls) if calls else []):
            results[k].append(result)
        for (t, parsed), own in zip(pending, results):
            _tool_turn(t, parsed, own, template, limits, eos_token_id)
        stats.tool_seconds += time.monotonic() - started


def run_agent_loop_stepwise(engine, trajectories: list[Trajectory], *, sampling, pool,
                            template: ToolTurnTemplate, parse: Callable[[str], ParseResult],
                            limits: AgentLimits, decode, eos_token_id: int | None,
                            stop: Callable[[list[bool]], bool] | None = None,
                            check_every: int = 16) -> TurnStats:
    """The loop of ``rl_config.async_engine``: every trajectory advances on its own.

    Each model turn is one request in the engine's batch (``engine.add_request`` /
    ``engine.step``, vLLM's engine API in process); a finished turn's calls go to the
    pool at once (``pool.submit``), and its next turn joins the batch as soon as its own
    calls are back, while the other trajectories keep decoding. No trajectory waits for
    another's slow tool call or long turn. ``tool_seconds`` counts only the time the loop
    waited with nothing to decode. Same seeds per (trajectory, turn) as the synchronous
    loop; which turns share a decode batch depends on when the tools return.

    ``stop(done per trajectory)``, asked every ``check_every`` engine steps (or tool
    waits) on every rank alike until it says so (it may be a collective), ends the loop
    early: turns still decoding keep their tokens so far and the trajectory pauses inside
    that turn; trajectories waiting for tools get their results and pause after the tool
    turn (partial rollout resumes both in a later pass). Without ``stop`` the loop runs
    until every trajectory is done.
    """
    stats = TurnStats()
    decoding: dict[str, Trajectory] = {}
    calling: list[tuple[Trajectory, ParseResult, list[Future]]] = []
    keep = stop is not None  # an aborted turn keeps its tokens

    def next_turn(t: Trajectory) -> None:
        rid = engine.add_request(t.prompt + t.tokens, sampling, seed=_turn_seed(t),
                                 max_tokens=_turn_budget(t, limits, sampling.max_tokens),
                                 **({"keep_partial": True} if keep else {}))
        decoding[rid] = t

    def advance() -> None:
        nonlocal calling
        if decoding:
            finished = engine.step()
        else:  # only tool calls out: wait for the first to end
            started = time.monotonic()
            wait([f for _, _, futures in calling for f in futures], return_when=FIRST_COMPLETED)
            stats.tool_seconds += time.monotonic() - started
            finished = []
        for rid, completion in finished:
            t = decoding.pop(rid)
            parsed = _model_turn(t, completion, limits, parse, decode, sampling.max_tokens)
            if parsed is not None:
                calling.append((t, parsed, [pool.submit(call)
                                            for call in _calls_to_run(t, parsed, limits)]))
        waiting = []
        for t, parsed, futures in calling:
            if not all(f.done() for f in futures):
                waiting.append((t, parsed, futures))
                continue
            _tool_turn(t, parsed, [f.result() for f in futures], template, limits,
                       eos_token_id)
            if not t.done and not t.paused:
                next_turn(t)
        calling = waiting

    for t in trajectories:
        if not t.done and not t.paused:
            next_turn(t)
    if stop is None:
        while decoding or calling:
            advance()
        return stats
    while True:
        for _ in range(check_every):
            if not (decoding or calling):
                break
            advance()
        if stop([t.done for t in trajectories]):
            break
    _pause(engine, decoding, calling, template, limits, eos_token_id)
    return stats


def _pause(engine, decoding: dict, calling: list, template: ToolTurnTemplate,
           limits: AgentLimits, eos_token_id: int | None) -> None:
    """The step-wise loop was stopped: a turn still decoding keeps its tokens and its
    trajectory pauses inside it (a turn without tokens yet is not started); one waiting
    for tools gets their results and pauses after its tool turn."""
    for rid, completion in engine.abort(list(decoding)):
        t = decoding[rid]
        if completion.token_ids:
            t.open_turn = t.add_model_turn(completion.token_ids, completion.logprobs,
                                           getattr(completion, "routed_experts", None))
            t.finish_reason = "abort"
        t.paused = True
    for t, parsed, futures in calling:
        _tool_turn(t, parsed, [f.result() for f in futures], template, limits, eos_token_id)
        t.paused = not t.done


def _turn_seed(t: Trajectory) -> int:
    return (t.seed + 7919 * t.turns) % 2**31


def _turn_budget(t: Trajectory, limits: AgentLimits, max_tokens: int) -> int:
    """Tokens the next model turn may generate: the rest of ``max_tokens`` for the turn (an
    open turn has used some), of the trajectory's total, and of the pass's budget."""
    turn_left = max_tokens - (len(t.tokens) - t.open_turn if t.open_turn >= 0 else 0)
    budget = min(turn_left, limits.max_total_response_length - len(t.tokens))
    return budget if t.pass_left is None else min(budget, t.pass_left)


def _model_turn(t: Trajectory, completion, limits: AgentLimits, parse, decode,
                max_tokens: int) -> ParseResult | None:
    """Append a model turn (or the rest of the open one); the tool calls the turn wrote, or
    None when the trajectory is done or paused."""
    start = t.add_model_turn(completion.token_ids, completion.logprobs,
                             getattr(completion, "routed_experts", None))
    # A turn cut at max_tokens still runs the calls it wrote (as MindSpeed-RL and verl do);
    # the template then closes the turn itself (glue, mask 0).
    t.finish_reason = completion.finish_reason or "length"
    if len(t.tokens) >= limits.max_total_response_length:
        t.done, t.finish_reason = True, "length"
        return None
    if (t.pass_left is not None and t.pass_left <= 0 and t.finish_reason == "length"
            and len(t.tokens) - start < max_tokens):  # cut by the pass, not by max_tokens
        t.paused, t.open_turn = True, start
        return None
    parsed = parse(decode(t.tokens[start:])) if t.tool_calls < limits.max_tool_calls \
        else ParseResult([], [])
    if not parsed.calls and not parsed.errors:
        t.done = True
        return None
    return parsed


def _calls_to_run(t: Trajectory, parsed: ParseResult, limits: AgentLimits) -> list:
    """The turn's calls within ``max_parallel_calls`` and the trajectory's remaining calls."""
    return parsed.calls[:min(limits.max_parallel_calls, limits.max_tool_calls - t.tool_calls)]


def _tool_turn(t: Trajectory, parsed: ParseResult, results: Sequence, template: ToolTurnTemplate,
               limits: AgentLimits, eos_token_id: int | None) -> None:
    """Append the results of the turn's calls (and its malformed calls' errors) as one tool
    turn, or end the trajectory when nothing came back or there is no room for it."""
    responses = []
    for result in results:
        t.tool_calls += 1
        t.tool_errors += int(result.error)
        t.tool_timeouts += int(result.timed_out)
        responses.append(result.text)
    room = limits.max_tool_calls - t.tool_calls
    for error in parsed.errors[:max(0, min(limits.max_parallel_calls - len(responses), room))]:
        t.tool_calls += 1   # a malformed call spends a call: the loop always ends
        t.tool_errors += 1
        responses.append(error)
    if not responses:
        t.done = True
        return
    kept = [truncate(r, limits.max_tool_response_length, limits.tool_response_truncate_side)
            for r in responses]
    ids = template.ids(kept, ended_with_eos=bool(t.tokens) and t.tokens[-1] == eos_token_id)
    if len(t.tokens) + len(ids) >= limits.max_total_response_length:
        # No room for the responses and a next turn: the trajectory ends on its call.
        t.done, t.finish_reason = True, "length"
        return
    t.add_tool_turn(ids)
    t.paused = t.pass_left is not None and t.pass_left <= 0


def trajectories_for(prompts: Sequence[Sequence[int]], n: int, seeds: Sequence[int]
                     ) -> list[Trajectory]:
    """``n`` trajectories per prompt (all samples of a prompt together), each with its seed."""
    return [Trajectory(prompt=list(p), seed=(s * 1_000_003 + j * 104_729) % 2**31)
            for p, s in zip(prompts, seeds) for j in range(n)]


__all__ = ["AgentLimits", "TemplateError", "ToolTurnTemplate", "Trajectory", "TurnStats",
           "run_agent_loop", "run_agent_loop_stepwise", "trajectories_for"]
