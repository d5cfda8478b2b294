"""GRPO with every RL role co-located on every rank (DESIGN §5).

One iteration is a short list of named phases; samples move only through the
TransferDock, weights only through the resharder:

  prompts -> reshard to generation -> rollout -> reshard to training -> reward
  -> advantages -> old log-probs -> reference log-probs -> update -> metrics -> checkpoint
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from mindspeed_rl.algorithms import group_normalized_advantages
from mindspeed_rl.data import PromptItem, load_prompt_dataset, slice_per_dp_rank
from mindspeed_rl.metrics import MetricsLogger, Timers, rank0_progress
from mindspeed_rl.rewards import compute_rewards
from mindspeed_rl.rollout import RolloutEngine, SamplingSettings
from mindspeed_rl.trainer.actor import (MegatronActor, OptimizerSettings, RowBatch,
                                        build_policy_model, forward_logprobs)

# TransferDock columns
PROMPT, RESPONSE, LOGP_ROLLOUT = "prompt_ids", "response_ids", "logprobs_rollout"
REWARD, ADVANTAGE, LOGP_OLD, LOGP_REF = "rewards", "advantages", "logprobs_old", "logprobs_ref"


@dataclass
class RolloutRows:
    """This generation-DP rank's rollout of one iteration (before it enters the dock)."""

    prompts: list[PromptItem]
    responses: list[list[list[int]]]  # [prompt][sample] token ids
    logprobs: list[list[list[float]]]
    row_ids: list[int]  # dock ids of the rows this rank put (TP_g rank 0 only)


class GRPOTrainer:
    """Builds every role on this rank and runs GRPO iterations."""

    def __init__(self, config, platform, layout) -> None:
        from transformers import AutoTokenizer

        from mindspeed_rl.checkpoint.trainer_state import has_training_checkpoint
        from mindspeed_rl.models.builder import describe_hf_dir
        from mindspeed_rl.parallel.groups import initialize_megatron_parallel
        from mindspeed_rl.resharding import Resharder, StateSwapper
        from mindspeed_rl.resharding.ledger import ByteLedger
        from mindspeed_rl.transfer_dock import ConsumerLayout, build_transfer_dock

        self.config, self.platform, self.layout = config, platform, layout
        mt, ac, rl, gen = (config.megatron_training, config.actor_config, config.rl_config,
                           config.generate_config)
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        # vLLM needs an HF-style directory (config.json + tokenizer); converted and
        # trained checkpoints carry one, so do HF model directories.
        self.model_dir = config.model.hf_dir or ac.load
        if not self.model_dir or not os.path.isfile(os.path.join(self.model_dir, "config.json")):
            raise ValueError("megatron_training.model must be an HF directory, or actor_config.load "
                             "a checkpoint made by tools/convert_ckpt.py (it holds config.json)")
        self.tokenizer = AutoTokenizer.from_pretrained(mt.tokenizer_name_or_path or self.model_dir)
        self.arch = describe_hf_dir(self.model_dir)

        # ---- data ------------------------------------------------------------------
        self.train_data = load_prompt_dataset(
            mt.data_path, self.tokenizer, rl.max_prompt_length, prompt_key=mt.prompt_key,
            answer_key=mt.answer_key, seed=mt.seed)
        self.test_data = None
        if mt.test_data_path:
            self.test_data = load_prompt_dataset(
                mt.test_data_path, self.tokenizer, rl.max_prompt_length, prompt_key=mt.prompt_key,
                answer_key=mt.answer_key, seed=mt.seed, shuffle=False,
                data_path_key="megatron_training.test_data_path")

        # ---- actor and reference (training layout) ---------------------------------
        initialize_megatron_parallel(layout, seed=mt.seed)
        dtype = torch.bfloat16 if mt.bf16 else torch.float32
        steps_per_iter = rl.epochs * (mt.global_batch_size // self.mini_batch_size)
        model = build_policy_model(self.arch, params_dtype=dtype, sequence_parallel=mt.sequence_parallel)
        resume = has_training_checkpoint(ac.load)
        if not resume:  # a resumed actor gets its weights from the checkpoint below
            self._load_initial_weights(model)
        self.actor = MegatronActor(model, OptimizerSettings(
            lr=ac.lr, min_lr=ac.min_lr, weight_decay=ac.weight_decay, adam_beta1=ac.adam_beta1,
            adam_beta2=ac.adam_beta2, clip_grad=ac.clip_grad, lr_decay_style=ac.lr_decay_style,
            lr_warmup_fraction=ac.lr_warmup_fraction, total_steps=mt.train_iters * steps_per_iter,
            use_distributed_optimizer=mt.use_distributed_optimizer, bf16=mt.bf16,
            max_consecutive_skipped_steps=rl.max_consecutive_skipped_steps))  # [issue 13]
        self.reference = self.ref_swapper = None
        if rl.init_kl_coef:
            self.reference = build_policy_model(self.arch, params_dtype=dtype,
                                                sequence_parallel=mt.sequence_parallel)
            if resume:  # the reference stays the policy the run started from
                self._load_initial_weights(self.reference)
            else:
                with torch.no_grad():
                    for p_ref, p in zip(self.reference.parameters(), model.parameters()):
                        p_ref.copy_(p)
            self.reference.requires_grad_(False)
            # The reference sits on host except while it computes log-probs.
            self.ref_swapper = StateSwapper(ByteLedger(), pin_memory=platform.device_type != "cpu")
            self.ref_swapper.refresh({"ref_param": list(self.reference.parameters())})
            self.ref_swapper.offload(["ref_param"])

        # ---- rollout engine (generation layout) and the resharder ------------------
        s = gen.sampling_config
        self.sampling = SamplingSettings(
            temperature=s.temperature, top_p=s.top_p, top_k=s.top_k, min_p=s.min_p,
            max_tokens=s.max_tokens, min_tokens=s.min_tokens, stop_token_ids=tuple(s.stop_token_ids))
        self.engine = RolloutEngine(
            self.model_dir, infer_tensor_parallel_size=gen.infer_tensor_parallel_size,
            max_num_seqs=gen.max_num_seqs, max_model_len=gen.max_model_len,
            max_num_batched_tokens=gen.max_num_batched_tokens,
            gpu_memory_utilization=gen.gpu_memory_utilization, enforce_eager=gen.enforce_eager,
            dtype=config.generation_dtype,
            seed=s.seed if s.seed is not None else mt.seed, load_format="dummy",
            device_type=platform.device_type)
        self.resharder = Resharder(
            model=model, model_chunks=self.actor.chunks, optimizer=self.actor.optimizer,
            engine=self.engine, weight_map=self.arch.weight_map,
            bucket_bytes=int(gen.resharding_bucket_mb * 2**20), platform=platform,
            offload_train_param=gen.offload_train_param, offload_train_grad=gen.offload_train_grad,
            offload_train_optimizer=gen.offload_train_optimizer)
        self.gen_dp_rank = self.rank // gen.infer_tensor_parallel_size
        self.is_gen_writer = self.rank % gen.infer_tensor_parallel_size == 0

        # ---- sample flow -------------------------------------------------------------
        self.dock = build_transfer_dock(rl.transfer_dock_mode, timeout_s=rl.transfer_dock_timeout_s)
        self.train_consumers = ConsumerLayout.megatron(
            self.world, layout.tensor_model_parallel_size, layout.pipeline_model_parallel_size)

        # ---- bookkeeping -------------------------------------------------------------
        self.iteration = 0
        if resume:
            self._load_checkpoint()
        self.timers = Timers(synchronize=platform.synchronize)
        self.logger = MetricsLogger(
            mt.log_dir, rank=self.rank, total_iterations=mt.train_iters,
            use_tensorboard=rl.use_tensorboard, use_wandb=rl.use_wandb,
            wandb_project=rl.wandb_project, run_config=config.to_dict(), resume=resume)
        if resume:
            self.logger.truncate_after(self.iteration)

    # ---- sizes -------------------------------------------------------------------
    @property
    def mini_batch_size(self) -> int:
        return self.config.rl_config.mini_batch_size or self.config.megatron_training.global_batch_size

    @property
    def n(self) -> int:
        return self.config.rl_config.n_samples_per_prompt

    # ---- the loop ------------------------------------------------------------------
    def train(self) -> dict[str, float]:
        """Run until ``train_iters``; evaluate before and after; return the last metrics."""
        mt = self.config.megatron_training
        last: dict[str, float] = {}
        if self.test_data is not None and self.iteration == 0:
            self._log_eval(0)
        for it in rank0_progress(range(self.iteration, mt.train_iters),
                                 total=mt.train_iters - self.iteration, desc="GRPO", rank=self.rank):
            last = self.run_iteration(it + 1)
            evaluate = self.test_data is not None and (
                (mt.test_interval and (it + 1) % mt.test_interval == 0) or it + 1 == mt.train_iters)
            if evaluate:
                last.update(self._log_eval(it + 1))
        return last

    def run_iteration(self, iteration: int) -> dict[str, float]:
        """One GRPO iteration (DESIGN §5); returns and logs its metrics."""
        t, mt = self.timers, self.config.megatron_training
        with t.phase("all"):
            prompts = self.train_data.next_batch(mt.global_batch_size)
            with t.phase("resharding_to_infer"):
                to_infer = self.resharder.to_infer()
            with t.phase("rollout"):
                rollout = self._rollout(prompts, iteration)
            with t.phase("resharding_to_train"):
                self.resharder.to_train()
            with t.phase("reward"):
                rewards = self._reward(rollout)
            with t.phase("adv"):
                self._advantages(rollout, rewards)
            with t.phase("old_log_p"):
                self._old_logprobs()
            with t.phase("reference_model"):
                self._ref_logprobs()
            with t.phase("update"):
                update_stats = self._update()
            self.dock.clear()
            self.iteration = iteration
            if (mt.save_interval and iteration % mt.save_interval == 0) or iteration == mt.train_iters:
                with t.phase("checkpoint"):
                    self._save_checkpoint()
        metrics = self._metrics(rollout, rewards, update_stats, to_infer, t.pop())
        self.logger.log(iteration, metrics)
        return metrics

    # ---- phases --------------------------------------------------------------------
    def _rollout(self, prompts: list[PromptItem], iteration: int) -> RolloutRows:
        """Generate on this generation-DP rank's prompts; TP_g rank 0 puts the rows."""
        gen_dp = self.world // self.config.generate_config.infer_tensor_parallel_size
        mine = slice_per_dp_rank(prompts, self.gen_dp_rank, gen_dp)
        # One seed per (iteration, prompt of the global batch): a resumed run samples
        # what the uninterrupted run sampled.
        first = self.gen_dp_rank * len(mine)
        seeds = [(self.config.megatron_training.seed * 1_000_003 + iteration * 10_007 + first + i)
                 % 2**31 for i in range(len(mine))]
        result = self.engine.generate([p.prompt_ids for p in mine], self.n, self.sampling,
                                      seeds=seeds, use_tqdm=self.rank == 0)
        responses = [[c.token_ids for c in group] for group in result.completions]
        logprobs = [[c.logprobs for c in group] for group in result.completions]
        columns = {}
        if self.is_gen_writer:
            columns = {
                PROMPT: [torch.tensor(p.prompt_ids) for p in mine for _ in range(self.n)],
                RESPONSE: [torch.tensor(r, dtype=torch.long) for group in responses for r in group],
                LOGP_ROLLOUT: [torch.tensor(lp, dtype=torch.float32)
                               for group in logprobs for lp in group],
            }
        row_ids = self.dock.put(columns, num_rows_per_group=self.n)
        return RolloutRows(mine, responses, logprobs, row_ids)

    def _reward(self, rollout: RolloutRows) -> torch.Tensor:
        """Rule rewards on the producing rank (it holds the answers); [rows] in put order."""
        rl = self.config.rl_config
        texts = [self.tokenizer.decode(r, skip_special_tokens=True)
                 for group in rollout.responses for r in group]
        answers = [p.answer for p in rollout.prompts for _ in range(self.n)]
        total, _ = compute_rewards(texts, answers, rl.verifier_function, rl.verifier_weight,
                                   row_labels=[f"{p.source_file} row {p.source_row} sample {j}"
                                               for p in rollout.prompts
                                               for j in range(self.n)])  # [issue 13]
        if self.is_gen_writer:
            self.dock.put({REWARD: list(total.unsqueeze(-1))}, rows=rollout.row_ids)
        else:
            self.dock.put({}, rows=[])
        return total

    def _advantages(self, rollout: RolloutRows, rewards: torch.Tensor) -> None:
        """Group-normalised advantages: all samples of a prompt are on this rank."""
        adv = group_normalized_advantages(rewards, self.n) if len(rewards) else rewards
        if self.is_gen_writer:
            self.dock.put({ADVANTAGE: list(adv.unsqueeze(-1))}, rows=rollout.row_ids)
        else:
            self.dock.put({}, rows=[])

    def _rows_per_dp_rank(self, num_prompts: int) -> int:
        return num_prompts * self.n // self.layout.data_parallel_size

    def _forward_phase(self, consumer: str, model, out_column: str, micro_batch_size: int) -> None:
        """Take every row, compute response log-probs with ``model``, put them back."""
        batch = self.dock.get(consumer, [PROMPT, RESPONSE],
                              self._rows_per_dp_rank(self.config.megatron_training.global_batch_size),
                              self.train_consumers)
        rows = RowBatch(batch[PROMPT], batch[RESPONSE], {})
        logp, _ = forward_logprobs(model, rows, micro_batch_size, self.arch.vocab_size)
        self.dock.put({out_column: logp}, rows=batch.rows)

    @property
    def on_policy(self) -> bool:
        """One optimizer step per iteration: the update's own log-probs are the old ones."""
        return self.config.rl_config.epochs == 1 and self.mini_batch_size == \
            self.config.megatron_training.global_batch_size

    def _old_logprobs(self) -> None:
        if self.on_policy:  # exactly equal to the update's detached log-probs: skip a forward
            return
        self._forward_phase("old_log_p", self.actor.model, LOGP_OLD,
                            self.config.rl_config.actor_forward_micro_batch_size)

    def _ref_logprobs(self) -> None:
        if self.reference is None:
            return
        self.ref_swapper.onload(["ref_param"])
        try:
            self._forward_phase("ref_log_p", self.reference, LOGP_REF,
                                self.config.rl_config.ref_forward_micro_batch_size)
        finally:
            self.ref_swapper.offload(["ref_param"])

    def _update(self) -> dict[str, float]:
        """``epochs`` passes of mini-batches; one optimizer step per mini-batch."""
        rl, ac, mt = self.config.rl_config, self.config.actor_config, self.config.megatron_training
        columns = [PROMPT, RESPONSE, ADVANTAGE] + ([] if self.on_policy else [LOGP_OLD]) + \
            ([LOGP_REF] if self.reference else [])
        steps = []
        for epoch in range(rl.epochs):
            for _ in range(mt.global_batch_size // self.mini_batch_size):
                batch = self.dock.get(f"actor_update_{epoch}", columns,
                                      self._rows_per_dp_rank(self.mini_batch_size),
                                      self.train_consumers)
                extras = {k: batch[k] for k in columns[2:]}
                steps.append(self.actor.update(
                    RowBatch(batch[PROMPT], batch[RESPONSE], extras), ac.micro_batch_size,
                    clip_ratio=rl.clip_ratio, kl_coef=rl.init_kl_coef, kl_kind=rl.kl_penalty,
                    entropy_coeff=rl.entropy_coeff, vocab_size=self.arch.vocab_size))
        return {k: sum(s[k] for s in steps) / len(steps) for k in steps[0]}

    # ---- metrics ---------------------------------------------------------------------
    def _gen_sums(self, values: list[float]) -> tuple[float, float, float, float]:
        """(sum, count, min, max) of per-row values over generation-DP ranks (TP_g once)."""
        own = values if self.is_gen_writer else []
        t = torch.tensor([sum(own), len(own)], dtype=torch.float64)
        ext = torch.tensor([-min(own, default=math.inf), max(own, default=-math.inf)],
                           dtype=torch.float64)
        dist.all_reduce(t)
        dist.all_reduce(ext, op=dist.ReduceOp.MAX)
        return t[0].item(), t[1].item(), -ext[0].item(), ext[1].item()

    def _metrics(self, rollout: RolloutRows, rewards: torch.Tensor, update: dict[str, float],
                 to_infer, timings: dict[str, float]) -> dict[str, float]:
        lengths = [float(len(r)) for group in rollout.responses for r in group]
        prompt_tokens = [float(len(p.prompt_ids)) for p in rollout.prompts for _ in range(self.n)]
        r_sum, r_cnt, r_min, r_max = self._gen_sums(rewards.tolist())
        l_sum, l_cnt, l_min, l_max = self._gen_sums(lengths)
        p_sum, _, _, _ = self._gen_sums(prompt_tokens)
        m = dict(timings)
        m.update({
            "reward/mean": r_sum / max(r_cnt, 1), "reward/min": r_min, "reward/max": r_max,
            "response_length/mean": l_sum / max(l_cnt, 1), "response_length/min": l_min,
            "response_length/max": l_max, "prompt_length/mean": p_sum / max(r_cnt, 1),
            "actor/pg_loss": update["pg_loss"], "actor/kl_loss": update["kl_loss"],
            "actor/entropy": update["entropy"], "actor/pg_clipfrac": update["pg_clipfrac"],
            "actor/ppo_kl": update["ppo_kl"], "actor/grad_norm": update["grad_norm"],
            "actor/skipped_steps": float(self.actor.step_guard.pop_skipped()),  # [issue 13]
            "actor/lr": self.actor.lr,
            "throughput/e2e_tokens_per_s_per_device":
                (p_sum + l_sum) / max(timings["timing/all"], 1e-9) / self.world,
            "throughput/rollout_tokens_per_s_per_device":
                l_sum / max(timings["timing/rollout"], 1e-9) / self.world,
            "resharding/peak_transition_bytes": to_infer.peak_bytes,
            "resharding/bytes_moved": to_infer.bytes_moved,
            "transfer_dock/row_bytes_received": float(self.dock.metrics.row_bytes_received),
            "transfer_dock/seconds": self.dock.metrics.seconds_put + self.dock.metrics.seconds_get,
            "transfer_dock/collectives": float(self.dock.metrics.num_collectives),
        })
        self.dock.reset_metrics()
        return m

    # ---- evaluation ------------------------------------------------------------------
    def evaluate(self) -> dict[str, float]:
        """Greedy accuracy on the test prompts (first verifier's score, e.g. the answer check)."""
        mt, rl = self.config.megatron_training, self.config.rl_config
        items = list(self.test_data)[: mt.num_test_prompts or len(self.test_data)]
        gen_dp = self.world // self.config.generate_config.infer_tensor_parallel_size
        mine = items[self.gen_dp_rank::gen_dp]  # TP_g peers share a slice
        self.resharder.to_infer()
        greedy = SamplingSettings(temperature=0.0, max_tokens=self.sampling.max_tokens,
                                  stop_token_ids=self.sampling.stop_token_ids)
        texts = []
        if mine:
            result = self.engine.generate([p.prompt_ids for p in mine], 1, greedy)
            texts = [self.tokenizer.decode(g[0].token_ids, skip_special_tokens=True)
                     for g in result.completions]
        self.resharder.to_train()
        _, per = compute_rewards(texts, [p.answer for p in mine], rl.verifier_function[:1], [1.0])
        scores = per[rl.verifier_function[0]].tolist() if mine else []
        s, c, _, _ = self._gen_sums(scores)
        self.last_eval_samples = list(zip([p.prompt_text for p in mine], texts))[:3]
        return {"eval/accuracy": s / max(c, 1), "eval/num_prompts": c}

    def _log_eval(self, iteration: int) -> dict[str, float]:
        metrics = self.evaluate()
        self.logger.log(iteration, metrics)
        return metrics

    # ---- checkpoints -----------------------------------------------------------------
    def _save_checkpoint(self) -> None:
        from mindspeed_rl.checkpoint.trainer_state import save_trainer_checkpoint

        save = self.config.actor_config.save
        if not save:
            return
        save_trainer_checkpoint(save, self.iteration, self.actor,
                                common={"data": self.train_data.state_dict()},
                                hf_files_from=self.model_dir, architecture=self.arch.name)

    def _load_checkpoint(self) -> None:
        from mindspeed_rl.checkpoint.trainer_state import load_trainer_checkpoint

        ac = self.config.actor_config
        common = load_trainer_checkpoint(ac.load, self.actor, load_optimizer=not ac.no_load_optim,
                                         load_rng=not ac.no_load_rng)
        self.iteration = int(common["iteration"])
        self.train_data.load_state_dict(common["data"])

    def _load_initial_weights(self, model) -> None:
        """The weights the run starts from: HF safetensors of the model directory, else the
        converted (release) checkpoint in actor_config.load."""
        hf_dir = self.config.model.hf_dir
        if hf_dir and any(Path(hf_dir).glob("*.safetensors")):
            from mindspeed_rl.models.builder import load_hf_weights
            from mindspeed_rl.models.hf_io import HFCheckpointReader

            load_hf_weights(model, self.arch, HFCheckpointReader(hf_dir))
            return
        load = self.config.actor_config.load
        if load and (Path(load) / "release").is_dir():
            from mindspeed_rl.checkpoint.megatron_dir import load_megatron_checkpoint

            load_megatron_checkpoint(model, load, iteration=None)
            return
        raise ValueError(
            "no initial weights: point megatron_training.model to an HF directory with "
            "safetensors, or actor_config.load to a checkpoint converted by tools/convert_ckpt.py "
            "(its release/ folder)")

    def close(self) -> None:
        self.engine.shutdown()
        self.logger.close()

