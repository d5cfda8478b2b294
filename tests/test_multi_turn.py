"""Multi-turn rollouts: token-exact trajectories, the loss mask, the agent loop's limits,
the config keys (docs/multi_turn.md)."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from mindspeed_rl.engine.micro_batches import LOSS_MASK, RowBatch, make_micro_batches
from mindspeed_rl.models.tiny import CHAT_TEMPLATE, build_tokenizer
from mindspeed_rl.rollout.agent_loop import (AgentLimits, TemplateError, ToolTurnTemplate,
                                             Trajectory, run_agent_loop)
from mindspeed_rl.agent_tools.parser import parse_hermes

# Qwen2.5's way of writing tool responses: consecutive tool messages inside one user turn,
# each in <tool_response> tags (written here for the test; the tiny tokenizer's own
# template writes them as a "tool" turn).
QWEN_LIKE_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'tool' %}"
    "{% if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}<|im_start|>user{% endif %}"
    "\n<tool_response>\n{{ message['content'] }}\n</tool_response>"
    "{% if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}<|im_end|>\n{% endif %}"
    "{% else %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
# A template that re-renders earlier turns once a tool message follows (drops the
# assistant's text before its tool call): not prefix-stable.
UNSTABLE_TEMPLATE = (
    "{% set has_tool = messages | selectattr('role', 'equalto', 'tool') | list | length > 0 %}"
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if has_tool and m['role'] == 'assistant' %}...{% else %}{{ m['content'] }}{% endif %}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")

_WORDS = ["the", "answer", "is", "42", "Let", "me", "compute", "12*34", "=", "print(7)",
          "\\boxed{408}", "step", "by", ",", ".", "(", ")", "x", "def", "f():", "return"]


def _tokenizer(template: str):
    tok = build_tokenizer()
    tok.chat_template = template
    return tok


def _text(rng: random.Random, words: int) -> str:
    text = " ".join(rng.choice(_WORDS) for _ in range(words))
    if rng.random() < 0.3:
        text += "\n" + " ".join(rng.choice(_WORDS) for _ in range(rng.randint(1, 5)))
    return text


def _conversation(rng: random.Random):
    """(prompt messages, [(assistant text, [tool responses])...], final assistant text)."""
    prompt = [{"role": "system", "content": _text(rng, 4)},
              {"role": "user", "content": _text(rng, rng.randint(1, 8))}]
    turns = []
    for _ in range(rng.randint(0, 3)):
        call = '<tool_call>\n{"name": "code_interpreter", "arguments": {"code": "print(1)"}}' \
               '\n</tool_call>'
        turns.append((_text(rng, rng.randint(1, 6)) + "\n" + call,
                      [_text(rng, rng.randint(1, 6)) for _ in range(rng.randint(1, 2))]))
    return prompt, turns, _text(rng, rng.randint(1, 8))


@pytest.mark.parametrize("template", [CHAT_TEMPLATE, QWEN_LIKE_TEMPLATE], ids=["chatml", "qwen"])
def test_trajectory_tokens_equal_one_rendering_of_the_final_conversation(template):
    """1,000 random conversations built the way the agent loop builds them (prompt ids, the
    model's tokens + EOS, then the template's tool turn) equal one apply_chat_template +
    tokenization of the final conversation, and the mask covers exactly the model's
    tokens."""
    tok = _tokenizer(template)
    turn = ToolTurnTemplate(tok)
    rng = random.Random(0)
    encode = lambda text: tok.encode(text, add_special_tokens=False)  # noqa: E731
    for case in range(1000):
        prompt, turns, final = _conversation(rng)
        ids = encode(tok.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True))
        t = Trajectory(prompt=ids, seed=0)
        messages = list(prompt)
        model_spans = []
        for text, responses in turns + [(final, None)]:
            model = encode(text) + [tok.eos_token_id]
            model_spans.append((len(t.tokens), len(model)))
            t.add_model_turn(model, [0.0] * len(model))
            messages.append({"role": "assistant", "content": text})
            if responses is not None:
                t.add_tool_turn(turn.ids(responses))
                messages += [{"role": "tool", "content": r} for r in responses]
        full = encode(tok.apply_chat_template(messages, tokenize=False))
        got = t.prompt + t.tokens
        assert got == full[:len(got)], case
        assert full[len(got):] == encode(turn.glue), case  # only the glue after the last EOS
        expected_mask = [0] * len(t.tokens)
        for start, length in model_spans:
            expected_mask[start:start + length] = [1] * length
        assert t.mask == expected_mask, case


def test_a_template_that_rerenders_earlier_turns_is_refused():
    with pytest.raises(TemplateError, match="re-renders the earlier turns"):
        ToolTurnTemplate(_tokenizer(UNSTABLE_TEMPLATE))


def test_the_loss_mask_zeroes_tool_tokens_in_every_layout():
    """response_mask reaches the micro-batch's mask (padded, token budget, packed): the token
    counts that token-mean divides by are the model's tokens only."""
    from mindspeed_rl.config.batch_plan import MicroBatching

    prompts = [torch.tensor([1, 2, 3]), torch.tensor([4, 5])]
    responses = [torch.tensor([6, 7, 8, 9, 10]), torch.tensor([11, 12, 13])]
    masks = [torch.tensor([1, 1, 0, 0, 1]), torch.tensor([0, 1, 1])]
    batch = RowBatch(prompts, responses, {LOSS_MASK: masks,
                                          "advantages": [torch.ones(5), torch.ones(3)]})
    for spec in (MicroBatching(micro_batch_size=2), MicroBatching(max_tokens=16),
                 MicroBatching(max_tokens=16, packed=True)):
        mbs = make_micro_batches(batch, spec)
        assert sum(mb.num_tokens for mb in mbs) == 5
        assert sum(float(mb.mask.sum()) for mb in mbs) == 5
        assert all(LOSS_MASK not in mb.extras for mb in mbs)
        for mb in mbs:
            for row, (j, start, n) in zip(mb.rows, mb.spans):
                assert mb.mask[j, start:start + n].tolist() == masks[row].float().tolist()


class _Completion:
    def __init__(self, token_ids, finish_reason="stop"):
        self.token_ids, self.logprobs = list(token_ids), [-0.5] * len(token_ids)
        self.finish_reason = finish_reason


class _Results:
    def __init__(self, text, error=False, timed_out=False):
        self.text, self.error, self.timed_out = text, error, timed_out


class _EchoPool:
    """Answers every call with its code (records the batches it got)."""

    def __init__(self):
        self.batches = []

    def run(self, calls):
        self.batches.append(calls)
        return [_Results(f"ran {c.arguments.get('code')}") for _, c in calls]


def _scripted_generate(tok, script):
    """A generate() that answers turn k of every trajectory with script[k] (+ EOS)."""
    turns: dict = {}

    def generate(prompts, seeds, budgets):
        out = []
        for p, budget in zip(prompts, budgets):
            k = turns[tuple(p[:3])] = turns.get(tuple(p[:3]), -1) + 1  # by prompt (unique)
            ids = tok.encode(script[min(k, len(script) - 1)], add_special_tokens=False)
            ids = ids + [tok.eos_token_id]
            out.append(_Completion(ids[:budget], "stop" if len(ids) <= budget else "length"))
        return out
    return generate


def _call(code: str) -> str:
    return ('<tool_call>\n{"name": "code_interpreter", "arguments": {"code": "' + code +
            '"}}\n</tool_call>')


class _TurnStream:
    """A generate() whose trajectory k writes turns[k] one after the other, each in as many
    calls as its budgets allow (a turn cut by the budget goes on where it stopped)."""

    def __init__(self, tok, turns):
        ids = [tok.encode(t, add_special_tokens=False) + [tok.eos_token_id] for t in turns]
        self.turns, self.where = ids, {}

    def __call__(self, prompts, seeds, budgets):
        out = []
        for p, budget in zip(prompts, budgets):
            turn, done = self.where.get(p[0], (0, 0))
            ids = self.turns[min(turn, len(self.turns) - 1)]
            piece = ids[done:done + budget]
            finished = done + len(piece) == len(ids)
            self.where[p[0]] = (turn + 1, 0) if finished else (turn, done + len(piece))
            out.append(_Completion(piece, "stop" if finished else "length"))
        return out


def test_a_trajectory_paused_by_partial_rollout_resumes_with_its_turn_and_mask():
    """Partial rollout x multi-turn: a pass budget pauses a trajectory inside a model turn
    or after a tool turn; written to the dock's columns and read back, it resumes where it
    was (the open turn's calls parsed from the whole turn) and ends as the same trajectory
    an uncut run writes: tokens, loss mask, log-probs, turns and tool calls."""
    from mindspeed_rl.rollout.agent_loop import run_agent_loop as loop
    from types import SimpleNamespace

    from mindspeed_rl.trainer.rollout_parts.rows import (PARTIAL, Row, columns_of, row_columns,
                                                         rows_of)
    from mindspeed_rl.transfer_dock import DockBatch

    tok = _tokenizer(CHAT_TEMPLATE)
    turns = [_call("print(1)"), _call("print(22)"), "so the answer is 23"]
    limits = AgentLimits(2, 1, 4000, 256, "middle")
    common = dict(pool=_EchoPool(), template=ToolTurnTemplate(tok), parse=parse_hermes,
                  limits=limits, decode=tok.decode, max_tokens=1000,
                  eos_token_id=tok.eos_token_id)
    whole = Trajectory(prompt=[5, 6, 7], seed=0)
    loop(_TurnStream(tok, turns), [whole], **common)
    assert whole.done and whole.tool_calls == 2 and whole.turns == 3
    names = row_columns(SimpleNamespace(partial_rollout=True, multi_turn=True,
                                        replays_rollout_routing=False))
    stream = _TurnStream(tok, turns)
    row = Row(Trajectory(prompt=[5, 6, 7], seed=0), prompt_index=0, group_id=0, sample_idx=0,
              weight_version=0)
    paused_in_turn = passes = 0
    while not row.t.done:
        row.t.pass_left, row.t.paused = 7, False  # a few tokens per pass: cut mid-turn
        loop(stream, [row.t], **common)
        row.finish = 0 if row.t.done else PARTIAL
        row.versions += [passes] * (len(row.t.tokens) - len(row.versions))
        paused_in_turn += row.t.open_turn >= 0
        columns = columns_of([row], names)  # into the dock and back, as between passes
        batch = DockBatch(rows=[0], columns=columns, token_lengths=[len(row.t.tokens)])
        [row] = rows_of(batch)
        passes += 1
    assert passes > 3 and paused_in_turn > 0
    assert row.t.tokens == whole.tokens and row.t.mask == whole.mask
    assert row.t.logprobs == pytest.approx(whole.logprobs)
    assert (row.t.turns, row.t.tool_calls) == (3, 2)
    assert row.versions == sorted(row.versions) and row.versions[-1] == passes - 1


@pytest.mark.parametrize("max_calls,max_parallel,expected_calls,expected_turns", [
    (2, 1, 2, 3), (1, 1, 1, 2), (0, 1, 0, 1), (4, 2, 4, 3)])
def test_agent_loop_limits(max_calls, max_parallel, expected_calls, expected_turns):
    tok = _tokenizer(CHAT_TEMPLATE)
    two_calls = _call("print(1)") + "\n" + _call("print(2)")
    script = [two_calls, two_calls, "the answer is 42"]
    pool = _EchoPool()
    trajectories = [Trajectory(prompt=[5, 6, 7 + s], seed=s) for s in range(3)]
    limits = AgentLimits(max_calls, max_parallel, 4000, 256, "middle")
    run_agent_loop(_scripted_generate(tok, script), trajectories, pool=pool,
                   template=ToolTurnTemplate(tok), parse=parse_hermes, limits=limits,
                   decode=tok.decode, max_tokens=1000, eos_token_id=tok.eos_token_id)
    for t in trajectories:
        assert t.done and t.tool_calls == expected_calls and t.turns == expected_turns
        assert len(t.tokens) == len(t.mask) == len(t.logprobs)
        assert all(lp == 0.0 for lp, m in zip(t.logprobs, t.mask) if m == 0)
    # every trajectory's calls of a turn go to the pool in one batch
    assert all(len(b) == len(trajectories) * min(max_parallel, 2) for b in pool.batches[:1])


def test_agent_loop_stops_at_the_total_response_length():
    tok = _tokenizer(CHAT_TEMPLATE)
    script = [_call("print(1)")] * 10
    t = Trajectory(prompt=[5, 6, 7], seed=0)
    limits = AgentLimits(100, 1, 300, 256, "middle")
    run_agent_loop(_scripted_generate(tok, script), [t], pool=_EchoPool(),
                   template=ToolTurnTemplate(tok), parse=parse_hermes, limits=limits,
                   decode=tok.decode, max_tokens=150, eos_token_id=tok.eos_token_id)
    assert t.done and len(t.tokens) <= 300 and t.finish_reason == "length"
    assert t.tool_calls >= 1  # it called, then ran out of room


def test_long_tool_responses_are_cut_to_max_tool_response_length():
    tok = _tokenizer(CHAT_TEMPLATE)

    class LongPool(_EchoPool):
        def run(self, calls):
            return [_Results("x" * 5000) for _ in calls]

    t = Trajectory(prompt=[5, 6, 7], seed=0)
    limits = AgentLimits(1, 1, 4000, 64, "left")
    run_agent_loop(_scripted_generate(tok, [_call("print(1)"), "done"]), [t], pool=LongPool(),
                   template=ToolTurnTemplate(tok), parse=parse_hermes, limits=limits,
                   decode=tok.decode, max_tokens=1000, eos_token_id=tok.eos_token_id)
    tool_text = tok.decode([x for x, m in zip(t.tokens, t.mask) if m == 0])
    assert tool_text.count("x") == 64


# ---- config: MindSpeed-RL's keys, their multi-turn config, bad input ----------------------
from tests.test_config import error_of, job  # noqa: E402,F401 - the fixture

from mindspeed_rl.config import load_config, make_plan  # noqa: E402

MSRL = Path("/work/.mirror/Ascend+MindSpeed-RL/repo")
GOOD_TOOL = """\
tools:
  - class_name: mindspeed_rl.agent_tools.code_interpreter.CodeInterpreter
    config: {num_workers: 2, rate_limit: 2, default_timeout: 5, memory_limit_mb: 256, type: native}
    tool_schema:
      type: function
      function:
        name: code_interpreter
        description: Runs Python.
        parameters: {type: object, properties: {code: {type: string}}, required: [code]}
"""


def _multi_turn(tmp_path, tool_yaml: str = GOOD_TOOL, **rl):
    (tmp_path / "tools.yaml").write_text(tool_yaml)
    return {"multi_turn_enable": True, "tool_config_path": str(tmp_path / "tools.yaml"),
            "max_tool_calls": 2, **rl}


def test_keys_load_with_their_meaning(job, tmp_path):
    config = load_config(job(megatron_training={"prompt_type": "qwen_retool"},
                             rl_config=_multi_turn(tmp_path, max_total_response_length=256,
                                                   tool_response_truncate_side="left")))
    rl = config.rl_config
    assert (rl.multi_turn_enable, rl.max_tool_calls, rl.max_parallel_calls,
            rl.max_total_response_length, rl.max_tool_response_length,
            rl.tool_response_truncate_side, rl.tool_parser_format) == (
        True, 2, 1, 256, 256, "left", "hermes")


@pytest.mark.parametrize("tool_yaml, rl, mt, words", [
    ("tools: [\n", {}, {}, ["rl_config.tool_config_path", "tools.yaml"]),
    (GOOD_TOOL.replace("mindspeed_rl.agent_tools.code_interpreter.CodeInterpreter",
                       "mindspeed_rl.agent_tools.search_tool.SearchTool"), {}, {},
     ["tools.yaml", "class_name", "SearchTool"]),
    (GOOD_TOOL.replace("        name: code_interpreter\n", ""), {}, {},
     ["tools.yaml", "function.name"]),
    (GOOD_TOOL, {"max_tool_response_length": 0}, {}, ["rl_config.max_tool_response_length"]),
    (GOOD_TOOL, {}, {"prompt_type": "qwen_r1"}, ["megatron_training.prompt_type", "tool"]),
    (GOOD_TOOL, {"tool_parser_format": "json"}, {}, ["rl_config.tool_parser_format"]),
    (GOOD_TOOL, {"tool_parser_format": "no_such_pkg.parsers:parse"}, {},
     ["rl_config.tool_parser_format", "does not resolve", "no_such_pkg"]),
    (GOOD_TOOL, {"max_total_response_length": 8}, {},
     ["rl_config.max_total_response_length"]),
], ids=["yaml", "unknown_class", "no_name", "response_length", "prompt_type", "parser",
        "parser_module", "total_length"])
def test_bad_input_names_the_file_and_key(job, tmp_path, tool_yaml, rl, mt, words):
    text = error_of(load_config, job(megatron_training={"prompt_type": "qwen_retool", **mt},
                                     rl_config=_multi_turn(tmp_path, tool_yaml, **rl)))
    for word in words:
        assert word in text, (word, text)


def test_raw_prompts_without_a_tool_template_are_refused(job, tmp_path):
    text = error_of(load_config, job(rl_config=_multi_turn(tmp_path)))
    assert "megatron_training.prompt_type" in text and "train.jsonl" in text


def test_ppo_is_refused(job, tmp_path):
    text = error_of(load_config, job(megatron_training={"prompt_type": "qwen_retool"},
                                     rl_config=_multi_turn(tmp_path),
                                     critic_config={"lr": 1e-5}), algorithm="ppo")
    assert "rl_config.multi_turn_enable" in text and "PPO" in text


@pytest.mark.skipif(not MSRL.exists(), reason="no MindSpeed-RL mirror")
def test_mindspeed_rl_multi_turn_config_passes_the_dry_run(tmp_path, monkeypatch):
    """Their dapo_qwen25_7b_A2_multi_turn.yaml and retool_config.yaml, unchanged, at 8 ranks:
    the tool maps to the SandboxFusion client (their sandbox_fusion_url)."""
    import subprocess

    from mindspeed_rl.agent_tools.config import load_tool_config

    for path in ("configs/dapo_qwen25_7b_A2_multi_turn.yaml", "configs/model/qwen25_7b.yaml",
                 "configs/tools/retool_config.yaml"):
        text = subprocess.run(["git", "-C", str(MSRL), "show", f"HEAD:{path}"], check=True,
                              capture_output=True, text=True).stdout
        target = tmp_path / (path if "tools" in path else path.removeprefix("configs/"))
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(text)
    monkeypatch.chdir(tmp_path)
    config = load_config(tmp_path / "dapo_qwen25_7b_A2_multi_turn.yaml", check_data=False,
                         algorithm="grpo")
    rl = config.rl_config
    assert (rl.multi_turn_enable, rl.max_tool_calls, rl.max_parallel_calls,
            rl.max_total_response_length, rl.max_tool_response_length,
            rl.tool_response_truncate_side, rl.tool_parser_format, rl.async_engine) == (
        True, 1, 1, 2048, 256, "middle", "hermes", True)
    assert rl.verifier_function == ("retool_reward",)
    (spec,) = load_tool_config(rl.tool_config_path)
    assert (spec.name, spec.kind, spec.sandbox_fusion_url) == (
        "code_interpreter", "sandbox_fusion", "http://localhost:8080/run_code")
    assert make_plan(config, 8).layout.infer_data_parallel_size == 8


# ---- vLLM TP > 1: one rank of each instance runs the tools -------------------------------

class _RecordingPool:
    """Stands in for ToolPool: answers each call with the rank that ran it."""

    def __init__(self) -> None:
        import torch.distributed as dist

        self.rank, self.calls = dist.get_rank(), 0

    def run(self, calls):
        self.calls += 1
        return [f"rank {self.rank} ran {call}" for _, call in calls]

    def close(self) -> None:
        pass


def _instance_pool_worker():
    import torch.distributed as dist

    from mindspeed_rl.trainer.rollout_parts.agent import InstancePool

    out = {}
    for tp_g in (2, 1):
        recording = _RecordingPool()
        pool = InstancePool(recording, tp_g, dist.get_world_size())
        calls = [(0, "a"), (1, f"b{dist.get_rank() // tp_g}")]
        out[tp_g] = [pool.run(calls) for _ in range(2)], recording.calls
    return out


def test_each_vllm_instance_runs_its_tool_calls_once():
    """With infer_tensor_parallel_size 2 on 4 ranks, ranks 0 and 2 run the calls of their
    instance and ranks 1 and 3 receive exactly those results (the tokens every rank of an
    instance appends must agree); with 1, every rank runs its own."""
    from mindspeed_rl.testing import run_on_ranks

    by_rank = run_on_ranks(_instance_pool_worker, 4, timeout=180)
    for rank, out in enumerate(by_rank):
        for tp_g, (results, calls) in out.items():
            src = rank - rank % tp_g
            assert results == [[f"rank {src} ran a", f"rank {src} ran b{rank // tp_g}"]] * 2
            assert calls == (2 if rank == src else 0), (tp_g, rank)


# ---- async_engine: the step-wise loop on the real engine and the real interpreter ----------

def _slow_every_other(text: str):
    """A scripted parser (a random model writes no tool calls): a call in every turn; the
    call sleeps 3 s when the turn's text has an even length."""
    from mindspeed_rl.agent_tools.parser import ParseResult, ToolCall

    code = f"import time\ntime.sleep({3 if len(text) % 2 == 0 else 0})\nprint({len(text)} * 7)"
    return ParseResult([ToolCall("code_interpreter", {"code": code}, code)], [])


def _stepwise_body(hf_dir: str, tools_yaml: str) -> dict:
    import time as clock

    from transformers import AutoTokenizer

    from mindspeed_rl.config.schema import SamplingConfig
    from mindspeed_rl.rollout import RolloutEngine
    from mindspeed_rl.rollout.agent_loop import (run_agent_loop_stepwise, trajectories_for)
    from mindspeed_rl.agent_tools.config import load_tool_config
    from mindspeed_rl.agent_tools.tool_pool import ToolPool

    tokenizer = AutoTokenizer.from_pretrained(hf_dir)
    engine = RolloutEngine(hf_dir, max_model_len=256, max_num_seqs=16,
                           gpu_memory_utilization=0.02)
    greedy = SamplingConfig(temperature=0.0, max_tokens=12)
    limits = AgentLimits(max_tool_calls=2, max_parallel_calls=1, max_total_response_length=120,
                         max_tool_response_length=40, tool_response_truncate_side="middle")
    prompts = [list(range(5 + i, 15 + 2 * i)) for i in range(8)]
    common = dict(template=ToolTurnTemplate(tokenizer), parse=_slow_every_other, limits=limits,
                  decode=tokenizer.decode, eos_token_id=tokenizer.eos_token_id)

    class Watched:
        """The real pool and engine, noting the turns added while a slow call was out."""

        def __init__(self, pool) -> None:
            self.pool, self.slow, self.added_meanwhile = pool, [], 0

        def submit(self, call, started=None):
            future = self.pool.submit(call, started)
            if "time.sleep(3)" in call.arguments["code"]:
                self.slow.append(future)
            return future

        def add_request(self, *args, **kwargs):
            self.added_meanwhile += any(not f.done() for f in self.slow)
            return engine.add_request(*args, **kwargs)

        def step(self):
            return engine.step()

    out = {}
    with ToolPool(load_tool_config(tools_yaml)) as pool:
        def generate(token_prompts, seeds, budgets):
            result = engine.generate(token_prompts, 1, greedy, seeds=seeds, max_tokens=budgets,
                                     use_tqdm=False)
            return [group[0] for group in result.completions]

        for name in ("batch-wide", "stepwise"):
            trajectories = trajectories_for(prompts, 1, list(range(len(prompts))))
            watched = Watched(pool)
            started = clock.monotonic()
            if name == "stepwise":
                run_agent_loop_stepwise(watched, trajectories, sampling=greedy, pool=watched,
                                        **common)
            else:
                run_agent_loop(generate, trajectories, pool=pool, max_tokens=12, **common)
            out[name] = {"tokens": [t.tokens for t in trajectories],
                         "mask": [t.mask for t in trajectories],
                         "calls": [t.tool_calls for t in trajectories],
                         "slow": len(watched.slow), "added_meanwhile": watched.added_meanwhile,
                         "seconds": clock.monotonic() - started}
    engine.shutdown()
    return out


@pytest.mark.slow
def test_stepwise_loop_continues_trajectories_while_a_slow_call_runs(tmp_path):
    """rl_config.async_engine: greedy trajectories equal the batch-wide loop's token for
    token, and turns were added to the engine while a 3 s call was still running (the
    batch-wide loop waits for it before any trajectory continues)."""
    from mindspeed_rl.models.tiny import make_tiny_hf_dir
    from mindspeed_rl.testing import run_on_ranks

    model = make_tiny_hf_dir("qwen2", tmp_path / "qwen2", max_position_embeddings=512)
    tools = Path(__file__).resolve().parents[1] / "configs" / "tools" / "code_interpreter.yaml"
    out = run_on_ranks(_stepwise_body, 1, str(model), str(tools), timeout=600)[0]
    batch, step = out["batch-wide"], out["stepwise"]
    print({k: (round(v["seconds"], 1), v["slow"], v["added_meanwhile"]) for k, v in out.items()})
    assert step["tokens"] == batch["tokens"] and step["mask"] == batch["mask"]
    assert step["calls"] == batch["calls"] == [2] * 8
    assert step["slow"] > 0 and step["added_meanwhile"] > 0
