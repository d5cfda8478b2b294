"""The RL trainer: every role co-located on every rank, one iteration a list of phases.

    while the batch is not ready:            # generation rounds (recipes.py)
        for phase in round_phases: metrics |= phase.run(ctx)
    for phase in the other phases:           # phases.py: get columns, compute, put columns
        metrics |= phase.run(ctx)
    flow.retire_all(); checkpoint; log

Samples move only through the TransferDock (checked against the column
contract), weights only through the resharder. The trainer's state — models,
optimizers, data position, row counters, KL coefficient, the dock — is what a
checkpoint saves (:meth:`state_dict` / :meth:`load_state_dict` for the
replicated part).
"""

from __future__ import annotations

import os
import time

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.stateful import Stateful

from mindspeed_rl.algorithms import KLController
from mindspeed_rl.metrics import MetricsLogger, Timers, rank0_progress
from mindspeed_rl.metrics.timers import add_phase_observer, remove_phase_observer
from mindspeed_rl.rewards import reward_pool_for
from mindspeed_rl.trainer.context import (BoundFlow, IterationState, PhaseContext, Ranks,
                                          TrainerState)
from mindspeed_rl.trainer.flow import SampleFlow
from mindspeed_rl.trainer.recipes import phases_of, split_rounds


class RLTrainer(Stateful):
    """Builds this rank's roles for ``config`` (its ``algorithm``) and runs iterations.

    ``Stateful`` (torch.distributed.checkpoint's protocol): :meth:`state_dict` and
    :meth:`load_state_dict` hold the replicated state that a checkpoint saves next to the
    models, optimizers and the dock's rows."""

    def __init__(self, config, plan, platform) -> None:
        self.config, self.plan, self.platform = config, plan, platform
        rl, mt = config.rl_config, config.megatron_training
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        # Verifier workers start first (they import while the models load); close() ends them.
        self.reward_pool = reward_pool_for(rl)
        self.model_dir, self.tokenizer, self.arch = _model(config)
        self.train_data, self.test_data = prompt_datasets(config, self.tokenizer)
        start = self._build_roles()  # None: resume from actor_config.load
        self.phases = phases_of(config)
        self.round_phases, self.once_phases = split_rounds(self.phases)
        self.ranks = _ranks(self.rank, self.world, plan.layout)
        self.flow = _sample_flow(config, self.phases, plan.layout)
        self.state = TrainerState(kl_ctrl=KLController(rl.init_kl_coef, rl.kl_ctrl_type,
                                                       rl.kl_target, rl.kl_horizon))
        self._saved_at = None  # the last iteration checkpointed
        if start is None:
            self.load_checkpoint(config.actor_config.load)
        self.timers = Timers(synchronize=platform.synchronize)
        self.profiler = _profiler(config, self.rank, self.world)
        self.efficiency = _efficiency(config, platform, self.roles.actor.model)
        self.logger = MetricsLogger(
            mt.log_dir, rank=self.rank, total_iterations=mt.train_iters,
            use_tensorboard=rl.use_tensorboard, use_wandb=rl.use_wandb,
            wandb_project=rl.wandb_project, run_config=config.to_dict(), resume=start is None)
        if start is None:
            self.logger.truncate_after(self.state.iteration)

    def _build_roles(self):
        """Megatron's process groups, then every role of this rank with its weights; returns
        where the actor's weights come from (None: resumed from ``actor_config.load``)."""
        from mindspeed_rl.checkpoint import weight_source
        from mindspeed_rl.checkpoint.safe_load import trust_checkpoints
        from mindspeed_rl.parallel.groups import initialize_megatron_parallel
        from mindspeed_rl.trainer.roles import build_roles

        config, ac = self.config, self.config.actor_config
        initialize_megatron_parallel(self.plan.layout, seed=config.megatron_training.seed)
        trust_checkpoints(ac.trust_checkpoint)  # before any checkpoint is read
        # Which weights (one stated rule, mindspeed_rl/checkpoint/weight_source.py); None: resume.
        start = weight_source.actor_start(config.model.hf_dir, ac.load, ac.finetune,
                                          save=ac.save)
        self.roles = build_roles(config, self.plan, self.platform, self.arch, self.model_dir,
                                 start=start)
        self.initial_weights = self._announce_weights(start)
        return start

    def _announce_weights(self, start) -> dict:
        """Say which weights the actor (and the reference) start from; returns the policy
        the run started from (the reference), recorded in every checkpoint."""
        from mindspeed_rl.checkpoint import weight_source

        ac = self.config.actor_config
        origin = self.roles.reference_source or start
        initial = (origin.to_dict() if origin is not None
                   else weight_source.recorded_start(ac.load))
        if self.rank == 0:
            ref = self.roles.reference_source
            actor = "resumed from " + ac.load if start is None else start.describe()
            print(f"actor weights: {actor}"
                  + (f"\nreference weights: {ref.describe()}" if ref is not None else ""),
                  flush=True)
            if self.config.rl_config.use_remove_padding:  # the packed-sequence attention path
                from mindspeed_rl.engine.packing import packing_notice

                print(packing_notice(self.roles.actor.model), flush=True)
        return initial

    # ---- the loop ----------------------------------------------------------------------
    def train(self) -> dict[str, float]:
        """Run until ``train_iters`` (or ``exit_duration_in_mins``); evaluate before, every
        ``test_interval`` and at the end; the last iteration always checkpoints."""
        mt = self.config.megatron_training
        last: dict[str, float] = {}
        if self.test_data is not None and self.state.iteration == 0:
            self.logger.log(0, self.evaluate())
        start, started = self.state.iteration, time.monotonic()
        for it in rank0_progress(range(start, mt.train_iters), total=mt.train_iters - start,
                                 desc=self.config.algorithm.upper(), rank=self.rank):
            last = self.run_iteration(it + 1)
            out_of_time = self._out_of_time(started)
            if self.test_data is not None and (
                    (mt.test_interval and (it + 1) % mt.test_interval == 0)
                    or it + 1 == mt.train_iters or out_of_time):
                evaluation = self.evaluate()
                self.logger.log(it + 1, evaluation)
                last.update(evaluation)
            if out_of_time:
                if self._saved_at != it + 1:
                    self.save_checkpoint()
                if self.rank == 0:
                    print(f"exit_duration_in_mins={mt.exit_duration_in_mins:g}: stopping after "
                          f"iteration {it + 1} of {mt.train_iters}", flush=True)
                break
        return last

    def _out_of_time(self, started: float) -> bool:
        """``exit_duration_in_mins`` has passed since training started (rank 0's clock
        decides, so every rank stops after the same iteration)."""
        budget = self.config.megatron_training.exit_duration_in_mins
        if budget is None:
            return False
        flag = torch.tensor([float(time.monotonic() - started >= budget * 60)])
        dist.broadcast(flag, src=0)
        return bool(flag.item())

    def run_iteration(self, iteration: int) -> dict[str, float]:
        """One iteration: generation rounds until the batch is ready, then the other phases
        once, in order; returns and logs its metrics (a metric of the generation phases
        describes the first round)."""
        it = IterationState(iteration)
        metrics: dict[str, float] = {}
        with self.timers.phase("all"):
            while True:
                it.batch_ready = True
                for key, value in self._run_phases(self.round_phases, it).items():
                    metrics.setdefault(key, value)
                if it.batch_ready:
                    break
                it.generation_round += 1
            metrics.update(self._run_phases(self.once_phases, it))
            metrics.update(self.efficiency.iteration())
            trace = self.flow.retire_all()
            if trace is not None:
                self._write_trace(iteration, trace)
            self.state.iteration = iteration
            mt = self.config.megatron_training
            if mt.save_interval and iteration % mt.save_interval == 0 \
                    or iteration == mt.train_iters:
                with self.timers.phase("checkpoint"):
                    self.save_checkpoint()
                    self._saved_at = iteration
        metrics.update(self.timers.pop())
        metrics.update(self._throughput(metrics))
        metrics.update(self._training_state_bytes())
        self.logger.log(iteration, metrics)
        return metrics

    def _run_phases(self, phases, it: IterationState) -> dict[str, float]:
        metrics: dict[str, float] = {}
        for phase in phases:
            ctx = PhaseContext(config=self.config, plan=self.plan, roles=self.roles,
                               train_data=self.train_data, tokenizer=self.tokenizer,
                               vocab_size=self.arch.vocab_size, ranks=self.ranks,
                               flow=BoundFlow(self.flow, phase.name), state=self.state, it=it,
                               reward_pool=self.reward_pool)
            start = time.perf_counter()
            with self.timers.phase(phase.name):
                metrics.update(phase.run(ctx))
            metrics.update(self.efficiency.after_phase(phase.name, time.perf_counter() - start))
        return metrics

    def _write_trace(self, iteration: int, trace: dict[str, list[int]]) -> None:
        """``rl_config.log_sample_flow``: the rows this rank received, per consumer."""
        import json

        folder = os.path.join(self.config.megatron_training.log_dir, "sample_flow")
        os.makedirs(folder, exist_ok=True)
        with open(os.path.join(folder, f"rank{self.rank}.jsonl"), "a") as f:
            f.write(json.dumps({"iteration": iteration, "rows": trace}) + "\n")

    def _training_state_bytes(self) -> dict[str, float]:
        """The actor's params, grads and optimizer state on the heaviest rank (resident after
        the update; LoRA trains adapters only: small grads and optimizer state)."""
        from mindspeed_rl.resharding.swap import TRAIN_GRAD, TRAIN_OPTIMIZER, TRAIN_PARAM

        swapper = self.roles.resharder.swapper
        sizes = torch.tensor([float(swapper.nbytes(r)) for r in (TRAIN_PARAM, TRAIN_GRAD,
                                                                  TRAIN_OPTIMIZER)])
        dist.all_reduce(sizes, op=dist.ReduceOp.MAX)
        return {f"memory/actor_{k}_bytes": v for k, v in zip(("params", "grads", "optimizer"),
                                                              sizes.tolist())}

    def _throughput(self, m: dict[str, float]) -> dict[str, float]:
        dock = self.flow.dock.metrics
        out = {
            "throughput/e2e_tokens_per_s_per_device":
                (m.pop("tokens/prompt") + m["tokens/response"]) / m["timing/all"] / self.world,
            "transfer_dock/row_bytes_received": float(dock.row_bytes_received),
            "transfer_dock/seconds": dock.seconds_put + dock.seconds_get,
            "transfer_dock/collectives": float(dock.num_collectives),
        }
        response = m.pop("tokens/response")
        if "timing/rollout" in m:  # DPO reads its responses from the data
            out["throughput/rollout_tokens_per_s_per_device"] = (
                response / m["timing/rollout"] / self.world)
        self.flow.dock.reset_metrics()
        return out

    # ---- evaluation --------------------------------------------------------------------
    def evaluate(self) -> dict[str, float]:
        """Greedy accuracy on the test prompts (``evaluation.py``); with multi-turn rollouts
        with the tools and without them, and the tool-call rate."""
        from mindspeed_rl.trainer.evaluation import evaluate
        from mindspeed_rl.trainer.rollout_parts.agent import agent_of

        mt = self.config.megatron_training
        items = list(self.test_data)[: mt.num_test_prompts or len(self.test_data)]
        mine = items[self.ranks.gen_dp_rank::self.plan.layout.infer_data_parallel_size]
        agent = (agent_of(self.roles, self.config, self.tokenizer, self.world)
                 if self.config.features.multi_turn else None)
        self.roles.resharder.to_infer()
        metrics, rows = evaluate(self.config, self.roles, self.tokenizer, mine, self.ranks,
                                 self.reward_pool, agent)
        self.roles.resharder.to_train()
        self.last_eval_samples = [(p.prompt_text, self.tokenizer.decode(
            r.t.tokens, skip_special_tokens=True)) for p, r in zip(mine, rows)][:3]
        return metrics

    # ---- checkpoints -------------------------------------------------------------------
    def state_dict(self) -> dict:
        """The replicated state: counters, KL coefficient, data position, the dock's metadata."""
        return {"iteration": self.state.iteration,
                "groups_generated": self.state.groups_generated,
                "kl_ctrl": self.state.kl_ctrl.state_dict(),
                "weight_version": self.roles.actor.weight_version,
                "data": self.train_data.state_dict(),
                "dock": self.flow.dock.controller.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.state.iteration = int(state["iteration"])
        self.state.groups_generated = int(state["groups_generated"])
        self.state.kl_ctrl.load_state_dict(state["kl_ctrl"])
        self.roles.actor.weight_version = int(state["weight_version"])
        self.train_data.load_state_dict(state["data"])
        self.flow.dock.controller.load_state_dict(state["dock"])

    def save_checkpoint(self) -> None:
        from mindspeed_rl.checkpoint.trainer_state import save_trainer_checkpoint

        save = self.config.actor_config.save
        if save:
            with self.roles.trainables_resident() as trainables:
                save_trainer_checkpoint(save, self.state.iteration, trainables,
                                        common={"trainer": self.state_dict(),
                                                "initial_weights": self.initial_weights},
                                        per_rank=self.flow.dock.warehouse.state_dict(),
                                        hf_files_from=self.model_dir,
                                        architecture=self.arch.name)

    def load_checkpoint(self, load_dir: str) -> None:
        from mindspeed_rl.checkpoint.trainer_state import load_trainer_checkpoint

        ac = self.config.actor_config
        with self.roles.trainables_resident() as trainables:
            common, cells = load_trainer_checkpoint(load_dir, trainables,
                                                    load_optimizer=not ac.no_load_optim,
                                                    load_rng=not ac.no_load_rng)
        self.load_state_dict(common["trainer"])
        self.flow.dock.warehouse.load_state_dict(cells or {})

    def close(self) -> None:
        if getattr(self, "profiler", None) is not None:
            remove_phase_observer(self.profiler.observe)
            self.profiler.close()
        if getattr(self, "reward_pool", None) is not None:
            self.reward_pool.close()
        self.roles.shutdown()
        self.logger.close()


# ---- building blocks ---------------------------------------------------------------------
def _model(config):
    """(HF-style model directory vLLM reads, tokenizer, architecture)."""
    from transformers import AutoTokenizer

    from mindspeed_rl.checkpoint.weight_source import hf_config_dir
    from mindspeed_rl.models.builder import describe_hf_dir

    mt = config.megatron_training
    model_dir = hf_config_dir(config.model.hf_dir, config.actor_config.load,
                              mt.tokenizer_name_or_path)
    tokenizer = AutoTokenizer.from_pretrained(mt.tokenizer_name_or_path or model_dir)
    return model_dir, tokenizer, describe_hf_dir(model_dir)


def prompt_datasets(config, tokenizer):
    """(the training prompts, the test prompts or None) as the job reads them: templated
    (with the tools described for ``prompt_type: qwen_retool``), tokenized, length-filtered;
    a DPO job's training data are its preference pairs."""
    from mindspeed_rl.data import load_prompt_dataset

    mt, rl = config.megatron_training, config.rl_config
    tools = _tool_prompt(config)
    # MindSpeed-RL reads prompts cut to seq_length (the plan warns when that cuts any)
    cut_to = mt.seq_length if mt.seq_length < rl.max_prompt_length else None
    if config.features.pairs:  # DPO: preference pairs (its test set holds prompts)
        train = pair_dataset(config, tokenizer)
    else:
        train = load_prompt_dataset(mt.data_path, tokenizer, rl.max_prompt_length,
                                    prompt_key=mt.prompt_key, answer_key=mt.answer_key,
                                    seed=mt.seed, shuffle=not mt.no_shuffle, tools=tools,
                                    cut_to=cut_to)
    test = None
    if mt.test_data_path:
        test = load_prompt_dataset(mt.test_data_path, tokenizer, rl.max_prompt_length,
                                   prompt_key=mt.prompt_key, answer_key=mt.answer_key,
                                   seed=mt.seed, shuffle=False,
                                   data_path_key="megatron_training.test_data_path", tools=tools,
                                   cut_to=cut_to)
    return train, test


def pair_dataset(config, tokenizer):
    """DPO's training pairs: templated prompts, chosen and rejected responses."""
    from mindspeed_rl.data import load_pair_dataset

    mt = config.megatron_training
    return load_pair_dataset(mt.data_path, tokenizer, mt.seq_length, seed=mt.seed,
                             shuffle=not mt.no_shuffle)


def _tool_prompt(config):
    """``prompt_type: qwen_retool``: the tools of ``rl_config.tool_config_path`` described in
    the system message (hermes), or None."""
    from mindspeed_rl.data import ToolPrompt
    from mindspeed_rl.agent_tools.config import load_tool_config, tool_system_prompt

    path = config.rl_config.tool_config_path
    if config.megatron_training.prompt_type != "qwen_retool" or path is None:
        return None
    return ToolPrompt(tool_system_prompt(load_tool_config(path)))


def _ranks(rank: int, world: int, layout) -> Ranks:
    """This rank's place: its vLLM instance (generation-DP rank) and whether it writes that
    instance's rows (the first of its TP_g ranks)."""
    tpg = layout.infer_tensor_parallel_size
    return Ranks(rank=rank, world=world, gen_dp_rank=rank // tpg, is_gen_writer=rank % tpg == 0)


def _sample_flow(config, phases, layout) -> SampleFlow:
    """The TransferDock of ``rl_config.transfer_dock_mode`` seen through the column contract
    of the algorithm's phases."""
    from mindspeed_rl.transfer_dock import build_transfer_dock

    rl = config.rl_config
    dock = build_transfer_dock(rl.transfer_dock_mode,
                               timeout_s=rl.transfer_dock_timeout_s or rl.collective_timeout_s)
    return SampleFlow(dock, [p.name for p in phases], _layouts(layout), trace=rl.log_sample_flow,
                      features=config.features.on)


def _efficiency(config, platform, model):
    """perf/padding_efficiency, perf/mfu per phase (measures the matmul peak;
    docs/metrics.md)."""
    from mindspeed_rl.engine.efficiency import PhaseEfficiency
    from mindspeed_rl.trainer.reductions import counts_in_train_layout

    return PhaseEfficiency(config.model, counted=counts_in_train_layout(),
                           device=platform.device(), dtype=model.config.params_dtype)


def _profiler(config, rank: int, world: int):
    """``profiler_config.integrated``: this rank's phase profiler, observing every phase
    (None when the rank does not record)."""
    from mindspeed_rl.config.profiling import profiled_phases, recording_ranks, trace_folder
    from mindspeed_rl.metrics.profiler import PhaseProfiler

    settings = config.profiler_config.integrated
    if not settings.profile or rank not in recording_ranks(settings, world):
        return None
    profiler = PhaseProfiler(settings, targets=profiled_phases(config), rank=rank,
                             folder=trace_folder(config))
    add_phase_observer(profiler.observe)
    return profiler


def _layouts(layout) -> dict:
    """The consumer layouts of the phases: ``train`` (megatron DP ranks, every TP/CP/PP peer
    receives its DP rank's rows), ``gen_writers`` (the first rank of each vLLM
    instance, which put the rollout rows) and ``gen`` (every rank of each vLLM instance:
    a partial rollout's continued rows)."""
    from megatron.core import parallel_state as ps

    from mindspeed_rl.parallel.groups import context_parallel
    from mindspeed_rl.transfer_dock import ConsumerLayout

    tpg = layout.infer_tensor_parallel_size
    return {"train": ConsumerLayout.megatron(layout.world_size,
                                             ps.get_tensor_model_parallel_world_size(),
                                             ps.get_pipeline_model_parallel_world_size(),
                                             context_parallel()[1]),
            "gen_writers": ConsumerLayout(tuple((k * tpg,)
                                                for k in range(layout.infer_data_parallel_size))),
            "gen": ConsumerLayout(tuple(tuple(range(k * tpg, (k + 1) * tpg))
                                        for k in range(layout.infer_data_parallel_size)))}
