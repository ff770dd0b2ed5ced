"""The fault registry, as data: each fault's patch or hook, the cell that reveals it, the checks
that must flag it, the configuration that must keep it silent, and where it acts (its stage and,
where it acts on some tensors and not all, which). ``tests/test_faults.py`` is generated from it."""

from __future__ import annotations

from types import MappingProxyType

from parity.faults import checkpoint_patches as ckp
from parity.faults import composition_patches as cp
from parity.faults import knob_patches as kp
from parity.faults import patches as p
from parity.faults import quant_patches as qp
from parity.faults import recipe_patches as rp
from parity.faults.fault import SCOPES, SITES, Fault

#: Where each fault acts, declared by hand (not derived from what flags it): the stage of
#: training (:data:`parity.judge.stages.STAGES`) its broken behaviour belongs to.
STAGE_OF_FAULT = {
    **dict.fromkeys(("resolver_misses_strict_name", "cast_child_inputs", "cast_buffers", "wrap_module",
                     "lose_buffer_marker", "meta_init_misplaced_shard", "divide_factor_not_stored",
                     "prefetch_not_stored", "placement_fn_dropped", "recast_foreign_params", "offload_policy_dropped",
                     "reshard_group_ignored", "unshard_in_backward_not_stored"), "setup"),
    **dict.fromkeys(("reshard_after_backward_not_stored", "reshard_after_backward_sticks"), "collectives"),
    **dict.fromkeys(("reshard_is_noop", "reshard_after_forward_sticks", "unsharded_layout_flips",
                     "compiled_forward_dropped", "reshard_forward_skipped", "reshard_off_reshards"), "forward"),
    **dict.fromkeys(("explicit_unshard_regathers", "explicit_unshard_issues_nothing"), "gather"),
    **dict.fromkeys(("drop_override", "holder_dt_bias_bf16", "local_amax", "stale_quantized_copy",
                     "mx_tiles_cut_by_shard", "mx_exponents_misaligned", "fp8_gather_off", "fp8_gather_off_one_weight",
                     "fp8_payload_misreported",
                     "offload_copy_in_stale", "backward_gather_stale",
                     "rank1_gather_corrupt"), "gather"),
    **dict.fromkeys(("drop_output_dtype", "output_cast_first_only", "perturb_output", "casts_inputs_anyway",
                     "eval_skips_reshard", "eval_skips_output_cast",
                     "eval_stale_after_step", "tp_partial_reduce_bf16"), "forward"),
    **dict.fromkeys(("perturb_input_grad", "detach_input", "checkpoint_keeps_activations", "selective_policy_ignored",
                     "is_last_backward_not_stored"),
                    "backward"),
    **dict.fromkeys(("bf16_reduce", "bf16_reduce_tied", "hide_reduction", "unfrozen_stays_frozen",
                     "prefetch_regathers", "post_backward_keeps_gathered", "not_last_backward_skips_sync", "finalize_skips_pending", "grad_dtype_dropped", "frozen_unit_reduces_bf16", "early_reduce_scatter",
                     "hsdp_replica_reduce_bf16", "hsdp_replica_sums", "hsdp_shard_group_sums", "hsdp_partial_bf16", "tp_reduces_twice", "combine_backward_regathers", "window_replays_accumulation",
                     "unused_drops_accumulated", "uneven_grad_row", "divide_factor_dropped", "unsharded_grad_kept",
                     "eval_resets_sync"),
                    "collectives"),
    # FSDP's final backward callback is where the step's reductions complete (post-reduce into .grad)
    "perturb_grad": "collectives",
    **dict.fromkeys(("scale_grad_norm", "rank1_grad_norm", "scaler_skips_dtensor"), "gradients"),
    "clip_local_norm": "clipping",
    **dict.fromkeys(("perturb_param", "rank1_step_passes_over_param", "decay_frozen", "adamw_step_shared", "moments_held_bf16", "scheduler_counts_ahead",
                     "scheduler_steps_before_optimizer"), "optimizer"),
    "state_dict_skips_reshard": "state-dict",
    **dict.fromkeys(("rename_param", "replace_param", "cast_storage"), "trained"),
    **dict.fromkeys(("misfile_optimizer_state", "save_rounds_moments", "save_narrows_live_moments"), "checkpoint-save"),
    **dict.fromkeys(("swap_optimizer_state", "step_counter_restarts", "load_regathers", "resharded_read_at_zero",
                     "load_reads_tensors_only", "load_keeps_live_hyperparameters", "load_keeps_zero_grads",
                     "scheduler_load_ignored",
                     "tp_shards_swapped_on_load", "crash_cross_load"), "checkpoint-load"),
    **dict.fromkeys(("owner_reduces_to_rank0", "load_splits_gather_input"), "resumed"),
    **dict.fromkeys(("rank_dependent_override", "fsdp_rank_dependent_dtype", "rank_dependent_unchecked", "rank_dependent_units",
                     "recompute_skips_input_cast", "crash", "hang", "raise"), "run"),
}


#: The tensors each fault confined to some tensors acts on, declared by hand from what its patch
#: changes (the fixture's FQNs; not derived from what flags it).
ACTS_ON = {
    "drop_override": ("*.A_log", "*.dt_bias"),  # the FP32 overrides
    "holder_dt_bias_bf16": ("blocks.1.holder.dt_bias",),
    "fp8_gather_off_one_weight": ("blocks.0.up.weight",),
    "bf16_reduce_tied": ("embed.weight",),  # the head's weight is the embedding's
    "resolver_misses_strict_name": ("*.dt_bias",),
    "perturb_grad": ("head.weight",),  # the first FSDP parameter of the first state: the root's
    "rank1_gather_corrupt": ("blocks.1.q_proj.weight",),
    "perturb_param": ("blocks.0.q_proj.weight",),  # the first parameter of the first group
    "rank1_step_passes_over_param": ("blocks.0.q_proj.weight",),
    "misfile_optimizer_state": ("blocks.0.pre.weight", "blocks.0.gain.gain"),  # moved, and where to
    "swap_optimizer_state": ("blocks.0.pre.weight", "blocks.1.pre.weight"),  # the first same-shape pair
    "cast_buffers": ("*.gate_scale",),  # the floating buffers
    "lose_buffer_marker": ("*.gate_scale",),
    "cast_storage": ("blocks.0.q_proj.weight",),  # the model's first parameter
    "meta_init_misplaced_shard": ("blocks.0.q_proj.weight",),  # the first sharded parameter
    "uneven_grad_row": ("embed.weight", "blocks.*.up.weight"),  # dimension 0 not a multiple of 2
    "unused_drops_accumulated": ("blocks.*.moe.experts.*",),
    "unfrozen_stays_frozen": ("blocks.0.adapter.*", "blocks.1.*"),  # frozen at the first all-gather
    "decay_frozen": ("blocks.*.router.gate.*",),  # the frozen parameters
    "frozen_unit_reduces_bf16": ("blocks.1.*",),  # the unit entirely frozen at its first forward
    "tp_partial_reduce_bf16": ("blocks.1.mlp.*",),  # the strict-FP32 block's TP layers
    "recast_foreign_params": ("moe.experts*",),
    "finalize_skips_pending": ("embed.weight",),  # the unit behind token ids
    "tp_shards_swapped_on_load": ("*.mlp.up.weight", "*.mlp.down.weight"),  # the first TP weight
}


def _fault(name, where, flags, cell, quiet=None, **kw) -> Fault:
    fault = Fault(name=name, where=where, flags=frozenset(flags), cell=MappingProxyType(cell),
                  quiet=MappingProxyType(quiet or {}), stage=STAGE_OF_FAULT[name], acts_on=ACTS_ON.get(name, ()), **kw)
    assert set(fault.scopes) <= set(SCOPES) and fault.site in ("", *SITES), f"{name}: unknown scope or site"
    return fault


_KDA2 = {"fixture": "kda", "path": "native", "ranks": 2}
_MAIN = ("main",)  # only the cell's own training (its first forward, its trained model)
_ACCUM = {"microbatches": 3, "sync": "last"}
_COMPOSED = {"fixture": "composed", "path": "native", "ranks": 4}
_FP8 = {"fixture": "fp8", "path": "native", "ranks": 2}
_SCHEDULED = {**_KDA2, "schedule": "decay"}  # quiet under "constant": no scheduler to break
_GRAD_DTYPE = {"fixture": "bf16_grads", "path": "native", "ranks": 2, "optimizer": "sgd", **_ACCUM}

FAULTS: dict[str, Fault] = {f.name: f for f in (
    _fault("drop_override", "FSDP resolves FP32 parameters to BF16 compute (FSDPParam.init_dtype_attrs)",
           {"grad.accum", "grad", "grad_norm", "trajectory", "trajectory.emulation", "dtype.compute", "divergence", "collectives", "grad.shard"}, _KDA2, patch=p.drop_override),
    _fault("holder_dt_bias_bf16", "FSDP all-gathers one holder's FP32 dt_bias (blocks.1.holder) in BF16",
           {"grad.accum", "grad", "grad_norm", "dtype.compute", "divergence", "collectives", "grad.shard"}, _KDA2, patch=p.holder_dt_bias_bf16),
    _fault("bf16_reduce", "FSDP reduces every gradient in BF16 (FSDPParam.init_dtype_attrs)",
           {"grad", "grad_norm", "dtype.reduce", "dtype.accum", "grad.accum", "collectives", "grad.shard"}, {**_KDA2, **_ACCUM},
           patch=p.bf16_reduce),
    _fault("bf16_reduce_tied", "FSDP reduces the tied embedding/head gradient in BF16 (FSDPParam.init_dtype_attrs)",
           {"grad", "grad_norm", "dtype.reduce", "dtype.accum", "grad.accum", "collectives", "grad.shard"},
           {"fixture": "lm", "path": "native", "ranks": 2, **_ACCUM},
           patch=p.bf16_reduce_tied),
    _fault("output_cast_first_only", "FSDP casts only the first element of a tuple output to output_dtype "
           "(FSDPState._cast_output_dtype): routed's hidden states keep the compute dtype",
           {"dtype.output", "dtype.boundary"},
           {"fixture": "routed", "path": "native", "ranks": 2, "output_dtype": "float32"},
           quiet={"output_dtype": "natural"}, patch=p.output_cast_first_only),
    _fault("drop_output_dtype", "FSDP skips the outermost unit's output cast (FSDPState._cast_output_dtype)",
           {"dtype.output", "dtype.boundary"}, {**_KDA2, "output_dtype": "float32"}, patch=p.drop_output_dtype),
    _fault("perturb_input_grad", "the root's input cast has a wrong backward on rank 0 (FSDPState._cast_forward_inputs)",
           {"input_grad"}, _KDA2, patch=p.perturb_input_grad),
    _fault("detach_input", "the root's input cast detaches the input: it gets no gradient (FSDPState._cast_forward_inputs)",
           {"input_grad"}, _KDA2, patch=p.detach_input),
    _fault("hide_reduction", "a torch build without FSDP's private reduction module (_fsdp_param_group.foreach_reduce): the probe is blind",
           {"grad.accum", "dtype.reduce"}, _KDA2, patch=p.hide_reduction, scopes=_MAIN),
    _fault("resolver_misses_strict_name", "the ranks' plan resolution misses the strict-FP32 name dt_bias "
           "(everything downstream, the reference included, follows the wrong plan)",
           {"plan"}, _KDA2, patch=p.resolver_misses_strict_name),
    _fault("perturb_grad", "one finalized gradient is off by 1e-4 (FSDPState._root_post_backward_final_callback)",
           {"grad", "grad_norm", "grad.shard"}, _KDA2, patch=p.perturb_grad),
    _fault("scale_grad_norm", "the sharded global norm is 1% high (torch.nn.utils.clip_grad_norm_)",
           {"grad_norm"}, _KDA2, patch=p.scale_grad_norm),
    _fault("rank1_grad_norm", "rank 1 alone computes a 1% high global norm (torch.nn.utils.clip_grad_norm_): "
           "rank 0, whose values are judged, is right", {"ranks"}, _KDA2, patch=p.rank1_grad_norm),
    _fault("rank1_gather_corrupt", "rank 1's all-gather hands compute blocks.1.q_proj.weight 1% off "
           "(FSDPParamGroup.wait_for_unshard); rank 0 is right",
           {"gathered", "grad.accum", "grad", "grad_norm", "trajectory", "trajectory.emulation", "divergence", "grad.shard",
            "checkpoint.same", "checkpoint.cross"}, _KDA2,
           quiet={"ranks": 1}, patch=p.rank1_gather_corrupt),
    _fault("perturb_param", "one optimizer update is off by 1e-4 (torch.optim.AdamW.step)",
           {"param"}, _KDA2, patch=p.perturb_param),
    _fault("eval_resets_sync", "a forward without gradients turns gradient sync back on for every unit "
           "(FSDPState._root_pre_forward): after an evaluation the rest of a no-sync window reduces every micro-batch",
           {"grad.accum", "collectives"}, {**_KDA2, "microbatches": 3, "sync": "last", "eval": "between-microbatches",
                                          "flags": "changed"},
           quiet={"flags": "each"}, patch=p.eval_resets_sync),
    _fault("unsharded_grad_kept", "FSDP leaves a zeroed full-size gradient on each unsharded parameter after taking "
           "it for the reduce-scatter (FSDPParamGroup._take_unsharded_grads_to_reduce): every value right, the memory "
           "FSDP saves held", {"grad.freed"}, {**_KDA2, **_ACCUM}, patch=p.unsharded_grad_kept),
    _fault("rank1_step_passes_over_param", "rank 1's optimizer step passes over blocks.0.q_proj.weight "
           "(torch.optim.AdamW.step): that rank's shard stays put and holds no optimizer state",
           # DCP refuses to save the state rank 1 lacks, so neither resumed run loads
           {"param", "trajectory", "trajectory.emulation", "optim.moments", "optim.state", "ranks", "checkpoint.same",
            "checkpoint.cross"}, _KDA2, quiet={"ranks": 1}, patch=p.rank1_step_passes_over_param),
    _fault("moments_held_bf16", "AdamW's moments are rounded to BF16 precision after every step (torch.optim.AdamW."
           "step, state held at the compute dtype's precision): each update is right, the state kept is not",
           {"optim.moments", "param"}, _KDA2, patch=p.moments_held_bf16),
    _fault("misfile_optimizer_state", "DCP files one parameter's optimizer state under another FQN (get_state_dict)",
           {"optim.state", "checkpoint.same", "checkpoint.cross"}, {"fixture": "frozen", "path": "legacy", "ranks": 2},
           patch=p.misfile_optimizer_state, scopes=_MAIN),
    _fault("save_rounds_moments", "DCP's save planner hands the writer every optimizer moment rounded to BF16 "
           "(DefaultSavePlanner.resolve_data): the training state is right, the checkpoint is not",
           {"checkpoint.saved", "checkpoint.same", "checkpoint.cross"}, _KDA2,
           patch=ckp.save_rounds_moments, scopes=("lifecycle",)),
    _fault("save_narrows_live_moments", "DCP's save leaves the live optimizer moments rounded to BF16 after writing "
           "them (dcp.save): the checkpoint is right, the state the job trains on is not",
           {"checkpoint.saved"}, _KDA2, patch=ckp.save_narrows_live_moments, scopes=("lifecycle",)),
    _fault("swap_optimizer_state", "DCP loads two same-shape parameters' optimizer states swapped (set_state_dict)",
           {"checkpoint.loaded", "checkpoint.same", "checkpoint.cross"}, {"fixture": "frozen", "path": "native", "ranks": 2},
           patch=p.swap_optimizer_state, scopes=("lifecycle",)),
    _fault("cast_child_inputs", "a sharding helper lets FP32 child units cast their inputs (unit policy)",
           {"unit.policy", "dtype.boundary"}, {**_KDA2, "path": "legacy"}, patch=p.cast_child_inputs),
    _fault("cast_buffers", "fully_shard casts the floating buffers of what it shards to BF16",
           {"grad.accum", "buffer", "grad", "grad_norm", "divergence", "grad.shard"}, _KDA2, patch=p.cast_buffers),
    _fault("wrap_module", "sharding the root leaves its head inside a wrapper (_fsdp_wrapped_module)",
           {"optim.moments", "grad.accum", "names", "identity", "dtype.storage", "dtype.compute", "dtype.reduce", "dtype.grad", "optim.state", "grad",
            "param", "trajectory", "trajectory.emulation", "grad.shard", "state_dict", "checkpoint.same", "checkpoint.cross"},
           _KDA2, patch=p.wrap_module),
    _fault("lose_buffer_marker", "FP32 markers kept on tensors: a device move replaces buffers and drops them",
           {"marker"}, _KDA2, patch=p.lose_buffer_marker, scopes=("markers",)),
    _fault("rank_dependent_override", "rank 1 resolves one parameter's compute dtype differently (the plan)",
           {"run"}, _KDA2, site="plan", hook=p.rank_dependent),
    _fault("fsdp_rank_dependent_dtype",
           "FSDP resolves compute dtypes differently on rank 1 (MixedPrecisionPolicy._resolve_for_param)",
           {"run"}, _KDA2, patch=p.fsdp_rank_dependent_dtype),
    _fault("rank_dependent_units", "a helper's units depend on the rank: rank 1 shards the last block inside "
           "the root's unit, every dtype the same", {"run"}, _KDA2, patch=p.rank_dependent_units),
    _fault("rank_dependent_unchecked", "a rank-dependent plan with parity's rank check removed: gloo aborts",
           {"run"}, _KDA2, site="plan", hook=p.rank_dependent, patch=p.skip_rank_check),
    _fault("perturb_output", "the model's output on rank 0's first micro-batch is off by 1% of its max",
           # the lifecycle's own training is not perturbed, so resuming from it differs too
           {"grad.accum", "output", "input_grad", "grad", "grad_norm", "trajectory", "trajectory.emulation", "divergence", "checkpoint.same",
            "checkpoint.cross", "grad.shard"}, _KDA2,
           site="sharded", hook=p.perturb_output, scopes=_MAIN),
    _fault("rename_param", "a parameter is renamed after training", {"names", "identity", "dtype.storage"}, _KDA2,
           site="trained", hook=p.rename, scopes=_MAIN),
    _fault("replace_param", "a parameter object is replaced after training", {"identity"}, _KDA2,
           site="trained", hook=p.replace, scopes=_MAIN),
    _fault("cast_storage", "a parameter's storage is cast after training", {"dtype.storage"}, _KDA2,
           site="trained", hook=p.cast_storage, scopes=_MAIN),
    # configurations real recipes use: each fault is revealed by its configuration only
    _fault("recompute_skips_input_cast",
           "FSDP's pre-forward skips the input cast in an activation-checkpoint recompute (FSDPState._pre_forward)",
           {"run"}, {"fixture": "residual_fp32", "path": "native", "ranks": 2, "checkpointing": "outer"},
           quiet={"checkpointing": "full"}, patch=rp.recompute_skips_input_cast),
    _fault("meta_init_misplaced_shard",
           "loading a full state dict after meta init gives rank 1 rank 0's rows of one parameter (set_model_state_dict)",
           {"grad.accum", "gathered", "output", "input_grad", "grad", "grad_norm", "param", "trajectory", "trajectory.emulation",
            "divergence", "grad.shard"}, {**_KDA2, "init": "meta"},
           quiet={"init": "seeded"}, patch=rp.meta_init_misplaced_shard),
    _fault("uneven_grad_row", "the last rank's shard of an uneven parameter loses its last gradient row (FSDPParam.to_sharded_dtensor)",
           {"grad", "grad_norm", "trajectory", "trajectory.emulation", "grad.shard"}, {"fixture": "uneven", "path": "native", "ranks": 2},
           quiet={"fixture": "lm"}, patch=rp.uneven_grad_row),
    _fault("unused_drops_accumulated",
           "a parameter unused in the synchronizing micro-batch is reduced as zero, dropping earlier accumulation",
           {"grad.accum", "grad", "grad_norm", "trajectory", "trajectory.emulation", "grad.shard"},
           {"fixture": "routed", "path": "native", "ranks": 2, **_ACCUM},
           quiet={"sync": "every"}, patch=rp.unused_drops_accumulated),
    _fault("window_replays_accumulation",
           "inside a no-sync window FSDP adds the unsharded gradients to themselves once more after a micro-batch "
           "(FSDPParamGroup._set_unsharded_grad_dtypes): the window holds, and reduces, twice what it computed",
           {"grad.accum", "grad", "grad_norm", "trajectory", "trajectory.emulation", "grad.shard"}, {**_KDA2, **_ACCUM},
           quiet={"sync": "every"}, patch=rp.window_replays_accumulation),
    _fault("unfrozen_stays_frozen", "FSDP keeps requires_grad from the first all-gather: unfrozen parameters get no gradient",
           {"optim.moments", "grad.accum", "grad", "grad_norm", "dtype.reduce", "dtype.grad", "optim.state", "checkpoint.same", "checkpoint.cross",
            "collectives", "checkpoint.collectives", "grad.shard", "param"}, {"fixture": "staged", "path": "native", "ranks": 2},
           quiet={"fixture": "frozen"},
           patch=rp.unfrozen_stays_frozen),
    _fault("scaler_skips_dtensor", "the gradient scaler leaves sharded gradients scaled (ShardedGradScaler._unscale_grads_)",
           # the sharded gradients' found-inf agreement (a functional all-reduce) is never issued: collectives
           {"grad.clipped", "grad_norm", "trajectory", "trajectory.emulation", "collectives"},
           {**_KDA2, "param_dtype": "float16"}, quiet={"param_dtype": "bfloat16"}, patch=rp.scaler_skips_dtensor),
    _fault("clip_local_norm", "clipping scales each rank's gradient shards by its own shards' norm, not the global "
           "one (torch.nn.utils.clip_grads_with_norm_)",
           {"clip", "grad.clipped", "trajectory", "trajectory.emulation"}, {**_KDA2, "clip": 0.01, "optimizer": "sgd"},
           quiet={"clip": 0.0}, patch=rp.clip_local_norm),
    _fault("adamw_step_shared", "AdamW's per-parameter step counters are one tensor, advanced once per parameter "
           "each step: the bias correction runs ahead (torch.optim.AdamW.step)",
           {"param", "trajectory", "trajectory.emulation", "optim.state"}, _KDA2, quiet={"optimizer": "sgd"},
           patch=rp.adamw_step_shared),
    _fault("decay_frozen", "AdamW decays parameters without a gradient (frozen ones) too (torch.optim.AdamW.step)",
           {"param"}, {"fixture": "routed", "path": "native", "ranks": 2}, quiet={"fixture": "frozen"},
           patch=rp.decay_frozen),
    _fault("eval_skips_reshard", "FSDP reshards after a forward only with gradients enabled: an evaluation forward "
           "leaves every unit unsharded (FSDPParamGroup.post_forward)",
           {"eval.reshard"}, {**_KDA2, "eval": "between-steps"}, quiet={"eval": "none"}, patch=rp.eval_skips_reshard),
    _fault("eval_skips_output_cast", "under no_grad FSDP skips the outermost unit's output cast: evaluation outputs "
           "keep the compute dtype (FSDPState._cast_output_dtype)",
           {"dtype.output", "dtype.boundary"}, {**_KDA2, "output_dtype": "float32", "eval": "between-steps"},
           quiet={"eval": "none"}, patch=rp.eval_skips_output_cast),
    _fault("post_backward_keeps_gathered", "FSDP's post-backward reshards nothing "
           "(FSDPParamGroup.post_backward): a later micro-batch's forward gathers no unit",
           {"collectives"}, {**_KDA2, **_ACCUM}, quiet={"microbatches": 1, "sync": "every"},
           patch=rp.post_backward_keeps_gathered),
    _fault("eval_stale_after_step", "an evaluation forward reads the unsharded weights of the last training forward, "
           "not the updated shards (FSDPParamGroup.pre_forward)",
           {"eval"}, {**_KDA2, **_ACCUM, "eval": "between-steps"}, quiet={"eval": "between-microbatches"},
           patch=rp.eval_stale_after_step),
    _fault("owner_reduces_to_rank0", "after resuming, the owner of FSDP-ignored parameters reduces their gradients "
           "to rank 0 only (dist.reduce for all_reduce): the other ranks' replicas part",
           {"checkpoint.same", "checkpoint.cross", "checkpoint.collectives"}, {"fixture": "ignored", "path": "native", "ranks": 2},
           quiet={"ranks": 1}, patch=ckp.owner_reduces_to_rank0, site="sharded", hook=ckp.loaded_models_marked,
           scopes=("lifecycle",)),
    _fault("step_counter_restarts", "loading optimizer state restarts AdamW's step counters at 1 (set_state_dict)",
           {"checkpoint.loaded", "checkpoint.same", "checkpoint.cross"},
           {"fixture": "frozen", "path": "native", "ranks": 2, "steps": 4},
           quiet={"steps": 2}, patch=ckp.step_counter_restarts, scopes=("lifecycle",)),
    _fault("scheduler_load_ignored", "loading a LambdaLR state dict keeps the fresh scheduler's state (a checkpoint "
           "that does not restore the schedule): the resumed step's rate is right, the next one restarts",
           {"checkpoint.loaded", "checkpoint.same", "checkpoint.cross"}, _SCHEDULED,
           quiet={"schedule": "constant"}, patch=ckp.scheduler_load_ignored, scopes=("lifecycle",)),
    _fault("scheduler_counts_ahead", "LambdaLR takes every step's factor one step early (get_lr)",
           {"lr", "param"}, _SCHEDULED, quiet={"schedule": "constant"},
           patch=rp.scheduler_counts_ahead),
    _fault("scheduler_steps_before_optimizer", "the recipe steps its scheduler in a hook right before each "
           "optimizer step, not after it: each step takes the next step's rate (Optimizer.register_step_pre_hook)",
           {"lr", "param"}, _SCHEDULED, quiet={"schedule": "constant"},
           patch=rp.scheduler_steps_before_optimizer),
    _fault("load_reads_tensors_only", "DCP's load reads tensor entries only: the optimizer's hyperparameters keep "
           "the fresh optimizer's (DefaultLoadPlanner.create_local_plan); equal by construction unless the "
           "destination is blanked first", {"checkpoint.loaded", "checkpoint.same", "checkpoint.cross"}, _KDA2,
           patch=ckp.load_reads_tensors_only, scopes=("lifecycle",)),
    _fault("load_keeps_live_hyperparameters", "setting a loaded optimizer state dict leaves the live param "
           "groups' hyperparameters as they were (set_state_dict): equal by construction unless they are "
           "blanked before the load", {"checkpoint.loaded", "checkpoint.same", "checkpoint.cross"}, _KDA2,
           patch=ckp.load_keeps_live_hyperparameters, scopes=("lifecycle",)),
    _fault("load_splits_gather_input", "after a load each FSDP parameter holds a new local shard while the "
           "all-gather input stays the old one (FSDPParam.reset_sharded_param not run): the resumed step is right, "
           "every later gather stale", {"checkpoint.same", "checkpoint.cross"}, _KDA2,
           patch=ckp.load_splits_gather_input, scopes=("lifecycle",)),
    _fault("load_keeps_zero_grads", "DCP's fresh-optimizer initialization leaves its zero gradients on every "
           "parameter (state_dict._init_optim_state): memory from load time on, numerically invisible",
           {"checkpoint.loaded"}, _KDA2, patch=ckp.load_keeps_zero_grads, scopes=("lifecycle",)),
    _fault("load_regathers", "after loading a sharded state dict every FSDP unit is all-gathered and resharded: "
           "numerically invisible (set_state_dict)",
           {"checkpoint.collectives"}, _KDA2, quiet={"ranks": 1}, patch=ckp.load_regathers, scopes=("lifecycle",)),
    _fault("resharded_read_at_zero", "DCP reads every chunk of a resharded load at offset 0 "
           "(narrow_tensor_by_index without offsets): only a checkpoint loaded on another layout shows it",
           {"checkpoint.moved"}, {**_KDA2, "move": "shrink"}, quiet={"move": "none"}, patch=ckp.resharded_read_at_zero,
           scopes=("lifecycle",)),
    _fault("divide_factor_dropped", "FSDP's reduction drops a unit's gradient divide factor and averages "
           "(foreach_reduce -> _get_gradient_divide_factors): only a recipe that sums shows it",
           {"grad", "grad_norm", "grad.shard"}, {**_KDA2, "reduction": "sum"}, quiet={"reduction": "mean"}, patch=kp.divide_factor_dropped),
    _fault("divide_factor_not_stored", "FSDPModule.set_gradient_divide_factor stores nothing: every unit keeps "
           "averaging", {"unit.policy", "grad", "grad_norm", "grad.shard"}, {**_KDA2, "reduction": "sum"}, quiet={"reduction": "mean"},
           patch=kp.divide_factor_not_stored),
    _fault("prefetch_regathers", "a unit prefetched in forward loses its pending all-gather and gathers "
           "again at its own pre-forward (FSDPParamGroup._prefetch_unshard)", {"collectives"},
           {**_KDA2, "prefetch": "explicit"}, quiet={"prefetch": "none"}, patch=kp.prefetch_regathers),
    _fault("prefetch_not_stored", "FSDPModule.set_modules_to_forward_prefetch stores nothing: no unit prefetches",
           {"unit.policy"}, {**_KDA2, "prefetch": "explicit"}, quiet={"prefetch": "none"}, patch=kp.prefetch_not_stored),
    _fault("reshard_after_backward_sticks", "FSDPModule.set_reshard_after_backward(True) is ignored after a False: "
           "the units stay gathered through the optimizer step and the next step computes with stale weights "
           "(from step 2: the state dict parity reads after step 0 reshards them, FSDP's pre-save hook)",
           {"collectives", "gathered", "output", "input_grad", "grad", "grad.accum", "grad_norm", "trajectory",
            "trajectory.emulation", "divergence", "grad.shard", "reshard.backward"}, {**_KDA2, **_ACCUM, "reshard_backward": "last", "steps": 3}, quiet={"reshard_backward": "every"},
           patch=kp.reshard_after_backward_sticks),
    _fault("explicit_unshard_regathers", "FSDPModule.unshard drops its all-gather's result: each unit's pre-forward "
           "gathers it again", {"collectives", "unshard"}, {**_KDA2, "unshard": "explicit"}, quiet={"unshard": "hooks"},
           patch=kp.explicit_unshard_regathers),
    _fault("reshard_after_backward_not_stored", "FSDPModule.set_reshard_after_backward stores nothing: units the "
           "recipe keeps gathered across a no-sync window are freed after every backward",
           {"reshard.backward"}, {"fixture": "kda", "path": "native", "ranks": 1, **_ACCUM, "reshard_backward": "last"},
           quiet={"reshard_backward": "every"}, patch=kp.reshard_after_backward_not_stored),
    _fault("is_last_backward_not_stored", "FSDPModule.set_is_last_backward stores nothing: every backward is the "
           "last (FSDP's default)", {"finalize.flagged"},
           {"fixture": "kda", "path": "native", "ranks": 1, **_ACCUM, "finalize": "flagged"},
           quiet={"finalize": "auto"}, patch=kp.is_last_backward_not_stored),
    _fault("explicit_unshard_issues_nothing", "FSDPModule.unshard issues no all-gather: each unit's pre-forward "
           "gathers as if the recipe had not asked", {"unshard"}, {**_KDA2, "unshard": "explicit"},
           quiet={"unshard": "hooks"}, patch=kp.explicit_unshard_issues_nothing),
    _fault("reshard_is_noop", "FSDPModule.reshard frees nothing: units the recipe reshards after an evaluation phase "
           "stay gathered", {"eval.reshard"}, {**_KDA2, "unshard": "explicit", "eval": "between-steps"},
           quiet={"unshard": "hooks"}, patch=kp.reshard_is_noop),
    _fault("reshard_after_forward_sticks", "FSDPModule.set_reshard_after_forward(True) is ignored after a False: "
           "the units stop resharding after forward once an evaluation phase turned it off",
           {"eval.reshard", "reshard.forward"},
           {**_KDA2, "unshard": "explicit", "eval": "between-steps"}, quiet={"unshard": "hooks"},
           patch=kp.reshard_after_forward_sticks),
    _fault("not_last_backward_skips_sync", "FSDPModule.set_is_last_backward(False) also turns gradient "
           "synchronization off: backwards before the last reduce-scatter nothing",
           {"grad.accum", "collectives", "grad.shard", "grad.freed"},
           {**_KDA2, "microbatches": 3, "finalize": "flagged"}, quiet={"finalize": "auto"},
           patch=kp.not_last_backward_skips_sync),
    _fault("finalize_skips_pending", "finalize_backward forgets the parameter groups left to it (FSDPState."
           "finalize_backward): units whose forward inputs need no gradient (behind token ids) are never reduced",
           {"optim.moments", "grad.accum", "collectives", "dtype.reduce", "dtype.grad", "grad", "grad_norm", "optim.state",
            "grad.freed", "trajectory",
            "trajectory.emulation", "checkpoint.same", "grad.shard", "param"},
           {"fixture": "lm", "path": "native", "ranks": 2, "finalize": "manual"}, quiet={"finalize": "auto"},
           patch=kp.finalize_skips_pending),
    _fault("offload_policy_dropped", "fully_shard drops its offload_policy: the recipe's shards stay on the device",
           {"unit.policy"}, {**_KDA2, "offload": "cpu"}, quiet={"offload": "none"}, patch=kp.offload_policy_dropped),
    _fault("offload_copy_in_stale", "with CPU offloading the all-gather copy-in reads a host copy of each shard taken "
           "at its first gather (FSDPParam.all_gather_inputs): later steps compute with the initial weights",
           {"grad.accum", "gathered", "output", "input_grad", "grad", "grad_norm", "trajectory", "trajectory.emulation",
            "checkpoint.same", "checkpoint.cross", "divergence", "grad.shard"}, {**_KDA2, "offload": "cpu"}, quiet={"offload": "none"}, patch=kp.offload_copy_in_stale),
    _fault("backward_gather_stale", "FSDP's backward all-gather hands compute the values its first backward gathered "
           "(FSDPParamGroup.wait_for_unshard): later steps' gradients use the initial weights",
           {"grad.accum", "gathered", "input_grad", "grad", "grad_norm", "trajectory", "trajectory.emulation", "checkpoint.same",
            "checkpoint.cross", "divergence", "grad.shard"}, {**_KDA2}, quiet={"reshard": False}, patch=rp.backward_gather_stale),
    _fault("reshard_group_ignored", "fully_shard takes an int reshard_after_forward as True: units reshard over every "
           "rank after forward, not the recipe's smaller group", {"unit.policy", "eval.reshard", "reshard.forward"},
           {"fixture": "kda", "path": "native", "ranks": 4, "reshard_to": "half", "eval": "between-steps"},
           quiet={"reshard_to": "all"}, patch=kp.reshard_group_ignored),
    _fault("reshard_forward_skipped", "a unit set to reshard after forward keeps its parameters gathered until "
           "backward (FSDPParamGroup.reshard returns early in forward)", {"reshard.forward"}, _KDA2,
           quiet={"reshard": False}, patch=kp.reshard_forward_skipped),
    _fault("reshard_off_reshards", "a unit set not to reshard after forward reshards anyway, and each backward "
           "all-gathers it again", {"reshard.forward"}, {**_KDA2, "reshard": False}, quiet={"reshard": True},
           patch=kp.reshard_off_reshards),
    _fault("unsharded_layout_flips", "from a parameter's second all-gather on, FSDP hands compute its unsharded "
           "matrices column-major (same values, transposed strides): compiled blocks recompile at every later forward",
           {"compile.graphs"}, {**_KDA2, "compile": "aot_eager"}, quiet={"compile": "none"},
           patch=kp.unsharded_layout_flips, scopes=_MAIN),
    _fault("compiled_forward_dropped", "fully_shard drops the compiled forward of every compiled block it wraps "
           "after the first (nn.Module._compiled_call_impl): the later blocks run eagerly, with the same numbers",
           {"compile.graphs"}, {"fixture": "frozen", "path": "legacy", "ranks": 2, "compile": "aot_eager"},
           quiet={"compile": "none"}, patch=kp.compiled_forward_dropped, scopes=_MAIN),
    _fault("placement_fn_dropped", "fully_shard drops its shard_placement_fn: parameters meant for dimension 1 "
           "are sharded on 0", {"placement"}, {**_KDA2, "placement": "dim1"}, quiet={"placement": "dim0"},
           patch=kp.placement_fn_dropped),
    _fault("casts_inputs_anyway", "FSDP casts a unit's inputs to its BF16 param_dtype although its policy says "
           "cast_forward_inputs=False (FSDPState._cast_forward_inputs)", {"grad.accum", "dtype.boundary", "grad", "grad_norm", "divergence", "grad.shard", "input_grad"},
           {"fixture": "self_cast", "path": "native", "ranks": 2, "cast_inputs": "model"},
           quiet={"cast_inputs": "fsdp"}, patch=kp.casts_inputs_anyway),
    _fault("checkpoint_keeps_activations", "torch's composable checkpoint never enters its saved-tensor hooks "
           "(checkpoint_activation): checkpointed blocks keep their activations, nothing runs again in backward",
           {"recompute"}, {**_KDA2, "checkpointing": "full"}, quiet={"checkpointing": "none"},
           patch=kp.checkpoint_keeps_activations),
    _fault("selective_policy_ignored", "torch's selective checkpoint caches nothing its policy saves "
           "(_CachingTorchDispatchMode): every matmul of a checkpointed block runs again in backward",
           {"recompute"}, {**_KDA2, "checkpointing": "selective"}, quiet={"checkpointing": "full"},
           patch=kp.selective_policy_ignored),
    _fault("unshard_in_backward_not_stored", "FSDPModule.set_unshard_in_backward stores nothing: a unit no backward "
           "reads (the embedding) is all-gathered in backward anyway", {"unit.policy", "collectives"},
           {"fixture": "untied_lm", "path": "native", "ranks": 2, "unshard_in_backward": "needed"},
           quiet={"unshard_in_backward": "all"}, patch=kp.unshard_in_backward_not_stored),
    _fault("grad_dtype_dropped", "FSDP forgets the parameters' grad_dtype at lazy init (FSDPParam.init_dtype_attrs): "
           "BF16 weights keep BF16 gradients instead of FP32",
           {"optim.moments", "dtype.grad", "grad", "grad_norm", "param", "grad.shard"}, _GRAD_DTYPE,
           quiet={"fixture": "kda"}, patch=kp.grad_dtype_dropped),
    _fault("frozen_unit_reduces_bf16", "a unit entirely frozen at its first forward keeps reducing in param_dtype "
           "after it is unfrozen (FSDPParamGroup._init_mp_dtypes)",
           # the resumed run's units see their first forward after the unfreeze: they reduce in FP32
           {"dtype.reduce", "grad", "checkpoint.same", "checkpoint.cross", "collectives", "checkpoint.collectives", "grad.shard"},
           {"fixture": "staged", "path": "legacy", "ranks": 2},
           quiet={"fixture": "frozen"}, patch=rp.frozen_unit_reduces_bf16),
    _fault("state_dict_skips_reshard", "FSDP registers no state-dict pre-save hook: a state dict taken while units are "
           "unsharded holds compute-dtype tensors (FSDPParamGroup._register_state_dict_hooks)",
           # the resumed step (lifecycle scope: hooks intact) re-gathers after its state dict, the broken one does not
           {"state_dict", "checkpoint.collectives"}, {**_KDA2, "reshard": False}, quiet={"reshard": True},
           patch=rp.state_dict_skips_reshard,
           scopes=_MAIN),
    _fault("early_reduce_scatter", "FSDP reduce-scatters (a zero buffer) inside a set_requires_gradient_sync(False) "
           "window: numerically invisible (FSDPParamGroup.post_backward)",
           {"collectives"}, {**_KDA2, **_ACCUM}, quiet={"sync": "every"}, patch=rp.early_reduce_scatter),
    # mesh compositions (4 ranks): each revealed by its composition only
    _fault("tp_partial_reduce_bf16", "DTensor reduces FP32 Partial placements in BF16 (Partial._reduce_value)",
           {"grad.accum", "dtype.tp_reduce", "tp.partial", "input_grad", "grad", "grad_norm", "trajectory", "trajectory.emulation",
            "divergence", "grad.shard"}, {**_COMPOSED, "mesh": "fsdp+tp"}, quiet={"mesh": "fsdp"},
           patch=cp.tp_partial_reduce_bf16),
    _fault("tp_reduces_twice", "DTensor all-reduces each Partial activation and input gradient twice, the "
           "first result dropped (Partial._reduce_value): numerically invisible", {"collectives"},
           {**_COMPOSED, "mesh": "fsdp+tp"}, quiet={"mesh": "hsdp"}, patch=cp.tp_reduces_twice),
    _fault("combine_backward_regathers", "the experts' reduce-scatter combine all-gathers its input's gradient twice "
           "in backward, the first result dropped (reduce_scatter_tensor_autograd): numerically invisible",
           # with the blocks checkpointed: a recompute may repeat their exchanges, never the experts'
           {"collectives"}, {**_COMPOSED, "mesh": "ep", "checkpointing": "full"}, quiet={"mesh": "fsdp"},
           patch=cp.combine_backward_regathers),
    _fault("hsdp_replica_reduce_bf16", "FSDP all-reduces HSDP gradients across replicas in BF16 (foreach_reduce)",
           {"dtype.reduce", "grad", "grad_norm", "collectives", "grad.shard", "grad.partial"}, {**_COMPOSED, "mesh": "hsdp"},
           quiet={"mesh": "fsdp"}, patch=cp.hsdp_replica_reduce_bf16),
    _fault("hsdp_replica_sums", "FSDP averages HSDP gradients over the shard group only; the replica all-reduce "
           "sums (foreach_reduce -> _get_gradient_divide_factors)",
           {"grad", "grad_norm", "grad.shard"}, {**_COMPOSED, "mesh": "hsdp"}, quiet={"mesh": "fsdp"},
           patch=cp.hsdp_replica_sums),
    _fault("hsdp_shard_group_sums", "FSDP's reduce-scatter sums HSDP gradients over the shard group where it should "
           "average; the replica all-reduce averages (foreach_reduce -> _get_gradient_divide_factors)",
           {"grad", "grad_norm", "grad.shard", "grad.partial"}, {**_COMPOSED, "mesh": "hsdp"}, quiet={"mesh": "fsdp"},
           patch=cp.hsdp_shard_group_sums),
    _fault("hsdp_partial_bf16",
           "HSDP holds reduce-scattered partial sums in BF16 until the replica all-reduce (foreach_reduce)",
           {"dtype.accum", "grad", "grad_norm", "grad.shard", "grad.partial"},
           {**_COMPOSED, "mesh": "hsdp", "microbatches": 2, "sync": "replicas-last"},
           quiet={"sync": "every"}, patch=cp.hsdp_partial_bf16),
    _fault("recast_foreign_params",
           "fully_shard casts ignored parameters on another parallelism's mesh (the experts) to param_dtype",
           {"grad.accum", "optim.moments", "ownership", "dtype.storage", "dtype.compute", "dtype.reduce", "dtype.grad", "optim.state", "input_grad",
            "grad", "grad_norm", "param", "trajectory", "trajectory.emulation", "divergence", "state_dict",
            "checkpoint.same", "checkpoint.cross", "grad.shard"},
           {**_COMPOSED, "path": "legacy", "mesh": "ep"}, quiet={"mesh": "fsdp"}, patch=cp.recast_foreign_params),
    _fault("tp_shards_swapped_on_load",
           "DCP restores a tensor-parallel weight with its tp shards exchanged (set_state_dict), "
           "fetching its peer's shard with an all-gather (a functional collective while loading)",
           {"checkpoint.loaded", "checkpoint.same", "checkpoint.cross", "checkpoint.collectives"},
           {**_COMPOSED, "mesh": "fsdp+tp"}, quiet={"mesh": "hsdp"},
           patch=cp.tp_shards_swapped_on_load, scopes=("lifecycle",)),
    # quantized weight groups (FP8 all-gather)
    _fault("local_amax", "tensorwise FP8 scales from each shard's own amax (no all-reduce over the shard group)",
           {"grad.accum", "quant.scale", "quant.values", "grad", "collectives", "grad.shard"}, {**_FP8, "weights": "fp8-tensorwise"}, quiet={"ranks": 1}, patch=qp.local_amax),
    _fault("stale_quantized_copy", "the FP8 copy is not refreshed after the optimizer step (QuantizedWeight._outdated)",
           {"grad.accum", "quant.refresh", "quant.values", "quant.blocks", "output", "input_grad", "grad", "grad_norm",
            "trajectory", "trajectory.emulation", "checkpoint.same", "checkpoint.cross", "divergence", "grad.shard"},
           {**_FP8, "weights": "mxfp8"}, quiet={"weights": "none"}, patch=qp.stale_quantized_copy),
    _fault("mx_tiles_cut_by_shard", "MX scales from 32x32 tiles of the local shard, cut by the shard boundary",
           {"grad.accum", "quant.blocks", "quant.values", "grad", "grad.shard"}, {**_FP8, "weights": "mxfp8"}, quiet={"weights": "fp8-tensorwise"}, patch=qp.mx_tiles_cut_by_shard),
    _fault("mx_exponents_misaligned", "the MX all-gather is right but each row block is dequantized with its "
           "neighbour's exponents (QuantizedWeight.fsdp_post_all_gather): only what the GEMM consumed shows it",
           {"grad.accum", "quant.blocks", "quant.values", "output", "input_grad", "grad", "grad_norm", "trajectory",
            "trajectory.emulation", "divergence", "grad.shard"}, {**_FP8, "weights": "mxfp8"}, quiet={"weights": "fp8-tensorwise"},
           patch=qp.mx_exponents_misaligned),
    _fault("fp8_gather_off", "the all-gather carries the dequantized weight in BF16 (FP8 all-gather off)",
           {"quant.gather", "collectives"}, {**_FP8, "weights": "fp8-tensorwise"}, quiet={"weights": "none"},
           patch=qp.fp8_gather_off),
    _fault("fp8_gather_off_one_weight", "one weight's all-gather carries its dequantized weight in BF16 (the first "
           "block's first), the others E4M3: a unit of the same size beside it all-gathers the right bytes",
           {"quant.gather", "collectives"}, {**_FP8, "weights": "fp8-tensorwise"}, quiet={"weights": "none"},
           site="sharded", hook=qp.fp8_gather_off_one_weight),
    _fault("fp8_payload_misreported", "the weight's extension reports an E4M3 payload but sends BF16: only the wire "
           "and the receiving side (no MX exponents consumed) show it", {"quant.gather", "quant.blocks", "collectives"}, {**_FP8, "weights": "mxfp8"}, quiet={"weights": "none"},
           patch=qp.fp8_payload_misreported),
    _fault("crash", "the last rank exits with code 17", {"run"}, _KDA2, site="start", hook=p.crash, scopes=_MAIN),
    _fault("crash_cross_load", "the last rank exits with code 17 while the checkpoint lifecycle builds the legacy "
           "model the native checkpoint loads into (an abort there): the training every rank observed is judged",
           {"checkpoint.same", "checkpoint.cross"}, _KDA2, site="sharded", hook=p.crash_building_legacy,
           scopes=("lifecycle",)),
    _fault("hang", "every rank sleeps forever", {"run"}, _KDA2, site="start", hook=p.hang, scopes=_MAIN),
    _fault("raise", "every rank raises RuntimeError", {"run"}, _KDA2, site="start", hook=p.raise_error, scopes=_MAIN),
)}
