"""What a valid run configuration is: the checks behind `config.load_config` and `check_runtime`.

Every user mistake becomes a `ConfigError` whose message is one line naming the key and the fix;
entry points print it and exit non-zero *before* JAX compiles anything. `validate` runs the
static checks, one function per concern, in a fixed order (the first problem is the one
reported): the mesh, the model's shape, its split over tp, the pipeline, the optimizer and the
loop — all a plan needs (`planning=True` stops there) — then the data options, checkpoints, the
supervisor, observability and the data source. `check_runtime` runs once the backend is known
(device count, platform features).

`config.py` imports this module (loading validates), so nothing here imports `config.py`: the
checks take a `config.Config`, or the sections they read, without naming their types.
"""

from __future__ import annotations

import dataclasses
import glob
import os

from megascale_jax import pipeline_schedule


class ConfigError(ValueError):
    """A user-facing configuration mistake; the message is one line with the fix."""


def require(ok: bool, msg: str) -> None:
    if not ok:
        raise ConfigError(msg)


def validate(cfg, planning: bool = False) -> None:
    """Static checks that need neither devices nor JAX. Raises ConfigError on the first problem.

    `planning=True` stops after the shape arithmetic: no feature-support or data checks."""
    check_mesh(cfg.mesh)
    check_model(cfg.model)
    check_tensor_parallel(cfg.model, cfg.mesh, cfg.parallel)
    check_pipeline(cfg.model, cfg.mesh, cfg.parallel)
    check_context_parallel(cfg.model, cfg.mesh, cfg.parallel)
    check_fp8(cfg.model, cfg.mesh, cfg.parallel)
    check_documents(cfg.model)
    check_optim(cfg.optim)
    check_train(cfg.train, cfg.mesh, cfg.parallel)
    if planning:
        return
    check_data_options(cfg.data, cfg.train)
    check_checkpoint(cfg.checkpoint)
    check_supervisor(cfg.supervisor, cfg.observe)
    check_observe(cfg.observe)
    check_data_source(cfg.data, cfg.model)


def check_documents(mo) -> None:
    """model.document_eos: a token of the vocabulary. Every layout keeps documents apart (the
    pipeline's stages and every attention implementation), so nothing else is refused."""
    if mo.document_eos is not None:
        require(0 <= mo.document_eos < mo.vocab,
                f"model.document_eos={mo.document_eos} must be a token id below model.vocab={mo.vocab}")


# ----------------------------------------------------------------------------- shapes (planning too)


def check_mesh(m) -> None:
    for key in ("dp", "pp", "cp", "tp"):
        require(getattr(m, key) >= 1, f"mesh.{key}={getattr(m, key)} must be >= 1")
    require(m.cpu_devices is None or m.cpu_devices >= 1,
            f"mesh.cpu_devices={m.cpu_devices} must be >= 1 (or null to follow the mesh)")


def check_model(mo) -> None:
    """The model's own sizes and the options that exclude one another."""
    for key in ("layers", "d_model", "heads", "kv_heads", "seq_len", "vocab"):
        require(getattr(mo, key) > 0, f"model.{key}={getattr(mo, key)} must be > 0")
    require(mo.mlp_ratio > 0, f"model.mlp_ratio={mo.mlp_ratio} must be > 0")
    require(mo.mlp_hidden is None or mo.mlp_hidden > 0, f"model.mlp_hidden={mo.mlp_hidden} must be > 0 (or null)")
    require(mo.norm_eps is None or mo.norm_eps > 0, f"model.norm_eps={mo.norm_eps} must be > 0 (or null)")
    require(mo.rope_base > 1, f"model.rope_base={mo.rope_base} must be > 1")
    require(0 < mo.rope_fraction <= 1 and mo.rotary_dims >= 2 and mo.rotary_dims % 2 == 0,
            f"model.rope_fraction={mo.rope_fraction} must rotate an even number >= 2 of the head's "
            f"{mo.head_dim} dims (0 < fraction <= 1)")
    require(not (mo.fused_mlp and mo.activation == "swiglu"),
            "model.fused_mlp=true has a bias+GeLU kernel only; set model.fused_mlp=false with activation=swiglu")
    require(not (mo.fused_mlp and not mo.bias),
            "model.fused_mlp=true fuses the MLP bias with GeLU; set model.fused_mlp=false with model.bias=false")
    require(mo.window is None or mo.window >= 1,
            f"model.window={mo.window} must be >= 1 (or null for full causal attention)")
    require(not (mo.fused_norm and mo.norm != "layernorm"),
            "model.fused_norm=true has a LayerNorm kernel only; set model.norm=layernorm or fused_norm=false")
    require(mo.d_model % mo.heads == 0, f"model.d_model={mo.d_model} must be divisible by model.heads={mo.heads}")
    # scan_unroll >= layers unrolls the whole scan (a config that unrolls 24 layers still runs with
    # model.layers=12, or a pipeline stage's share of them)
    require(mo.scan_unroll >= 1, f"model.scan_unroll={mo.scan_unroll} must be >= 1 (1: the layer scan rolled)")
    require(mo.loss_chunks >= 1 and mo.seq_len % mo.loss_chunks == 0,
            f"model.loss_chunks={mo.loss_chunks} must be >= 1 and divide model.seq_len={mo.seq_len}")
    require(mo.heads % mo.kv_heads == 0,
            f"model.heads={mo.heads} must be divisible by model.kv_heads={mo.kv_heads} (grouped-query attention)")


def check_tensor_parallel(mo, m, p) -> None:
    """The model's widths split over mesh.tp; sequence parallelism and collective matmul."""
    require(mo.heads % m.tp == 0, f"model.heads={mo.heads} must be divisible by mesh.tp={m.tp}")
    require(mo.kv_heads % m.tp == 0 or m.tp % mo.kv_heads == 0,
            f"model.kv_heads={mo.kv_heads} and mesh.tp={m.tp} must divide one another (kv heads split over tp, "
            "or each replicated over tp/kv_heads ranks); choose a mesh.tp that divides kv_heads or is a multiple of it")
    require(mo.kv_heads % m.tp == 0 or mo.kv_heads * mo.head_dim % m.tp == 0,
            f"model.kv_heads={mo.kv_heads} x head_dim={mo.head_dim} must be divisible by mesh.tp={m.tp} (the "
            "column-parallel matmul splits the replicated k/v projections' columns over tp); use a smaller mesh.tp")
    require(mo.mlp_dim % m.tp == 0,
            f"MLP width (model.mlp_hidden, else from mlp_ratio)={mo.mlp_dim} must be divisible by mesh.tp={m.tp}")
    if p.sequence_parallel:
        require(mo.seq_len % m.tp == 0,
                f"model.seq_len={mo.seq_len} must be divisible by mesh.tp={m.tp} with parallel.sequence_parallel=true")
    if p.tp_overlap == "collective_matmul":
        require(p.sequence_parallel, "parallel.tp_overlap=collective_matmul fuses sequence parallelism's "
                                     "all-gather/reduce-scatter; set parallel.sequence_parallel=true")
        require(p.tp_chunks >= 1, f"parallel.tp_chunks={p.tp_chunks} must be >= 1")
        require(not (p.tp_bidirectional and p.tp_chunks % 2),
                f"parallel.tp_chunks={p.tp_chunks} must be even with parallel.tp_bidirectional=true "
                "(half the pieces go each way); use an even count or tp_bidirectional=false")
        require((mo.seq_len // m.tp) % p.tp_chunks == 0,
                f"collective matmul cuts each device's model.seq_len/mesh.tp={mo.seq_len // m.tp} tokens into "
                f"parallel.tp_chunks={p.tp_chunks} pieces; choose a seq_len or tp_chunks that divides")


def check_context_parallel(mo, m, p) -> None:
    """mesh.cp > 1: the sequence split into cp slices, and the options that cannot run on them yet
    (parallel/context_parallel.py says why each is left out)."""
    if m.cp == 1:
        return
    require(mo.seq_len % m.cp == 0, f"model.seq_len={mo.seq_len} must be divisible by mesh.cp={m.cp} "
                                    "(each cp rank holds seq_len/cp tokens of every sequence)")
    require(mo.attention != "cudnn" or mo.window is not None,
            f"mesh.cp={m.cp} with full attention (model.window=null) runs with model.attention=xla|pallas, not "
            "cudnn (its kernel takes no queries' offset into the keys): set model.attention=pallas, or a model.window")
    require((mo.seq_len // m.cp) % mo.loss_chunks == 0,
            f"model.loss_chunks={mo.loss_chunks} must divide each cp rank's model.seq_len/mesh.cp="
            f"{mo.seq_len // m.cp} tokens (every loss slice takes its share of each rank's part)")
    require(not p.sequence_parallel or (mo.seq_len // m.cp) % m.tp == 0,
            f"parallel.sequence_parallel=true splits each cp rank's model.seq_len/mesh.cp={mo.seq_len // m.cp} "
            f"tokens over mesh.tp={m.tp}, which must divide them")


def check_fp8(mo, m, p) -> None:
    require(not (mo.fp8 and m.tp > 1 and p.tp_overlap == "collective_matmul"),
            "model.fp8=true: the collective matmul has no FP8 GEMM yet; use parallel.tp_overlap=none|xla with mesh.tp > 1")


def check_pipeline(mo, m, p) -> None:
    """The layers cut into mesh.pp x parallel.pp_virtual chunks, and a schedule that exists."""
    require(p.pp_virtual >= 1, f"parallel.pp_virtual={p.pp_virtual} must be >= 1")
    require(p.microbatches >= 1, f"parallel.microbatches={p.microbatches} must be >= 1")
    require(mo.layers % (m.pp * p.pp_virtual) == 0,
            f"model.layers={mo.layers} must be divisible by mesh.pp={m.pp} x parallel.pp_virtual={p.pp_virtual}")
    if m.pp > 1:
        try:
            pipeline_schedule.check(p.pp_schedule, m.pp, p.pp_virtual, p.microbatches)
        except ValueError as e:
            raise ConfigError(str(e)) from None
    else:
        require(p.pp_virtual == 1, f"parallel.pp_virtual={p.pp_virtual} needs mesh.pp > 1")


def check_optim(o) -> None:
    require(o.lr > 0, f"optim.lr={o.lr} must be > 0")
    require(o.warmup >= 0, f"optim.warmup={o.warmup} must be >= 0")
    require(0 <= o.min_lr_ratio <= 1, f"optim.min_lr_ratio={o.min_lr_ratio} must be in [0, 1]")
    require(0 < o.decay_fraction <= 1, f"optim.decay_fraction={o.decay_fraction} must be in (0, 1] "
            "(the share of train.steps optim.schedule=wsd decays over)")
    require(o.weight_decay >= 0, f"optim.weight_decay={o.weight_decay} must be >= 0")
    require(o.clip is None or o.clip > 0, f"optim.clip={o.clip} must be > 0 (or null to disable)")


def check_train(t, m, p) -> None:
    """The loop's counts, and a global batch that splits into dp replicas x microbatches."""
    require(t.steps >= 1, f"train.steps={t.steps} must be >= 1")
    require(t.global_batch >= 1, f"train.global_batch={t.global_batch} must be >= 1")
    require(t.log_every >= 1, f"train.log_every={t.log_every} must be >= 1")
    require(t.eval_every >= 0, f"train.eval_every={t.eval_every} must be >= 0")
    require(t.eval_batches >= 0, f"train.eval_batches={t.eval_batches} must be >= 0 (0 = no validation loss)")
    require(t.eval_tasks_every >= 0, f"train.eval_tasks_every={t.eval_tasks_every} must be >= 0 (0 = only at the end)")
    require(t.seed >= 0, f"train.seed={t.seed} must be >= 0")
    require(t.sample_at_end >= 0, f"train.sample_at_end={t.sample_at_end} must be >= 0 (0 = no sample)")
    require(t.sample_at_end == 0 or t.sample_prompt != "",
            "train.sample_prompt is empty; give the text the end-of-run sample continues (or train.sample_at_end=0)")
    per_step = m.dp * p.microbatches
    require(t.global_batch % per_step == 0,
            f"train.global_batch={t.global_batch} must be divisible by mesh.dp*parallel.microbatches="
            f"{m.dp}*{p.microbatches}={per_step}")


# ----------------------------------------------------------------------------- a run (not when planning)


def check_data_options(d, t) -> None:
    require(0 <= d.val_fraction < 1, f"data.val_fraction={d.val_fraction} must be in [0, 1) (0: nothing held out)")
    require(d.val_fraction > 0 or t.eval_batches == 0,
            "data.val_fraction=0 holds nothing out for the validation loss; set train.eval_batches=0 too "
            "(a run without validation), or hold some data out")
    require(d.prefetch >= 0, f"data.prefetch={d.prefetch} must be >= 0 (0 = synchronous)")
    if d.stream:  # training/streaming.py; a reader count the processes cannot share is checked at the start
        require(d.source in ("jsonl", "parquet"), f"data.stream=true tokenizes jsonl/parquet shards while training; "
                                                  f"data.source={d.source} needs no tokenizing (set data.stream=false)")
        require(d.mix is None, "data.stream=true does not mix sources yet (data.mix); set data.stream=false (each "
                               "source tokenized into its cache first) or stream one source")
        require(d.readers is None or (d.readers >= 1 and t.global_batch % d.readers == 0),
                f"data.readers={d.readers} must divide train.global_batch={t.global_batch} (each reader serves "
                "global_batch/readers rows of every step); choose a divisor, or null")
        require(d.shuffle_window >= 1, f"data.shuffle_window={d.shuffle_window} must be >= 1 (1: no shuffling)")


def check_checkpoint(c) -> None:
    require(c.every >= 0, f"checkpoint.every={c.every} must be >= 0 (0 = never save)")
    require(c.keep >= 1, f"checkpoint.keep={c.keep} must be >= 1")
    require(c.memory_every >= 0, f"checkpoint.memory_every={c.memory_every} must be >= 0 (0 = no memory snapshots)")
    require(c.device_copy_gib is None or c.device_copy_gib >= 0,
            f"checkpoint.device_copy_gib={c.device_copy_gib} must be >= 0 (0 = no copy on the device; null = what fits)")


def check_supervisor(sv, ob) -> None:
    """Heartbeat and hang timing, restarts, and straggler eviction (which reads the timings)."""
    require(sv.heartbeat_s > 0, f"supervisor.heartbeat_s={sv.heartbeat_s} must be > 0")
    require(sv.stall_floor_s is None or sv.stall_floor_s > 0,
            f"supervisor.stall_floor_s={sv.stall_floor_s} must be > 0 (or null: hang_timeout_s)")
    require(sv.stall_steps > 1, f"supervisor.stall_steps={sv.stall_steps} must be > 1 (a multiple of the recent step time)")
    require(sv.hang_timeout_s > 2 * sv.heartbeat_s,
            f"supervisor.hang_timeout_s={sv.hang_timeout_s} must exceed 2 x supervisor.heartbeat_s={sv.heartbeat_s}, "
            "or every late heartbeat looks like a hang")
    require(sv.max_restarts >= 0, f"supervisor.max_restarts={sv.max_restarts} must be >= 0")
    require(sv.straggler_check_s >= 0, f"supervisor.straggler_check_s={sv.straggler_check_s} must be >= 0 (0 = never)")
    require(not (sv.evict_stragglers and not (ob.timings and sv.straggler_check_s > 0)),
            "supervisor.evict_stragglers=true needs observe.timings=true and supervisor.straggler_check_s > 0 "
            "(stragglers are found in the timings)")


def check_observe(ob) -> None:
    require(ob.straggler_threshold > 0, f"observe.straggler_threshold={ob.straggler_threshold} must be > 0")
    require(ob.straggler_window >= 3, f"observe.straggler_window={ob.straggler_window} must be >= 3")
    require(ob.profile_every >= 0, f"observe.profile_every={ob.profile_every} must be >= 0 (0 = off)")
    require(not (ob.profile_every and not ob.timings),
            f"observe.profile_every={ob.profile_every} needs observe.timings=true (device times go to the timings)")


def check_data_source(d, mo) -> None:
    """The tokens exist and are readable; byte-level sources need a vocabulary of 256 or more. A
    mixture (data.mix) checks each of its sources as data.path."""
    if d.mix is not None:
        require(d.source != "stdlib", "data.mix mixes sources of data.source=files|tokens|jsonl|parquet, not stdlib; "
                                      "set data.source")
        require(d.path is None, "data.mix replaces data.path (each mix key is a source's path); give one of them")
        for path, weight in d.mix.items():
            require(weight > 0, f"data.mix[{path!r}]={weight} must be > 0 (a source's weight)")
            check_data_source(dataclasses.replace(d, path=path, mix=None), mo)
        return
    if d.source == "stdlib":
        require(mo.vocab >= 256, f"data.source=stdlib is byte-level: model.vocab={mo.vocab} must be >= 256")
    elif d.source == "files":
        require(d.path is not None, "data.source=files needs data.path=GLOB (e.g. 'corpus/*.txt')")
        matches = [f for f in glob.glob(d.path, recursive=True) if os.path.isfile(f)]
        require(bool(matches), f"data.path={d.path!r} matches no files; pass a glob of readable text files")
        unreadable = [f for f in matches if not os.access(f, os.R_OK)]
        require(not unreadable, f"data.path: {unreadable[:1]} is not readable; fix its permissions")
        require(mo.vocab >= 256, f"data.source=files is byte-level: model.vocab={mo.vocab} must be >= 256")
    elif d.source in ("jsonl", "parquet"):
        suffix = ".jsonl.gz" if d.source == "jsonl" else ".parquet"
        require(d.path is not None, f"data.source={d.source} needs data.path=GLOB (e.g. 'shards/*{suffix}')")
        require(d.tokenizer is not None, f"data.source={d.source} needs data.tokenizer=PATH (a tokenizer.json or a "
                                         "Hugging Face model directory)")
        require(bool(d.text_field), "data.text_field must name the field each document's text is in (e.g. text)")
        require(d.tokenize_workers >= 0, f"data.tokenize_workers={d.tokenize_workers} must be >= 0 (0: one a core)")
    else:
        require(d.path is not None, "data.source=tokens needs data.path=FILE (a flat uint16/uint32 token file)")
        require(os.path.isfile(d.path) and os.access(d.path, os.R_OK),
                f"data.path={d.path!r} is not a readable file; pass a flat {d.token_dtype} token file")


# ----------------------------------------------------------------------------- at run time


def check_process_count(m, process_count: int, platform: str | None) -> None:
    """Before JAX starts, once the process count is known (a scheduler's task count, e.g.
    SLURM_NTASKS): every process holds as many of the mesh's devices as every other, so a count
    that does not divide the mesh is one line here, not an error from every task after the
    distributed start-up. `platform` is the one JAX_PLATFORMS names, if any: on the CPU
    (`cpu`) the devices per process are known too (mesh.cpu_devices) and checked in full."""
    require(process_count >= 1, f"--num-processes={process_count} must be >= 1")
    if platform == "cpu":
        check_cpu_devices(m, process_count)
    elif m.size % process_count:
        raise ConfigError(f"mesh {m.product} devices cannot be split evenly over "
                          f"{process_count} processes (--num-processes, the job's task count); choose a task count "
                          f"that divides {m.size}, or a mesh that {process_count} divides")


def check_cpu_devices(m, process_count: int) -> None:
    """On the CPU each process simulates `mesh.cpu_devices_per_process` devices, so the mesh must
    have that many x (number of processes) of them."""
    product = m.size
    if m.cpu_devices_per_process(process_count) * process_count != product:
        given = (f"mesh.cpu_devices={m.cpu_devices}" if m.cpu_devices is not None
                 else f"{process_count} processes")
        fix = ("leave mesh.cpu_devices unset (it follows the mesh)" if m.cpu_devices is not None
               else f"choose a mesh divisible by {process_count}")
        per = f" per process x {process_count} processes" if process_count > 1 and m.cpu_devices else ""
        raise ConfigError(f"mesh {m.product} devices do not match {given}{per}; {fix}")


def check_runtime(cfg, platform: str, device_count: int, process_count: int = 1) -> None:
    """Checks that need the backend: device count and platform-specific features."""
    m = cfg.mesh
    product = m.size
    if platform == "cpu":
        check_cpu_devices(m, process_count)
        per_process = m.cpu_devices_per_process(process_count)
        if product > device_count:
            raise ConfigError(
                f"the mesh needs {per_process} CPU devices per process but this process has only "
                f"{device_count // process_count}; set mesh.cpu_devices before JAX starts (fresh process)")
    elif product != device_count:
        raise ConfigError(
            f"mesh {m.product} but {device_count} {platform} devices are "
            "visible; choose mesh sizes whose product is the device count")
    if cfg.model.attention == "cudnn":
        if platform != "gpu":
            raise ConfigError(f"model.attention=cudnn needs an NVIDIA GPU (platform is {platform}); use model.attention=xla")
        if cfg.model.dtype != "bfloat16":
            raise ConfigError("model.attention=cudnn needs model.dtype=bfloat16")
        if cfg.model.head_dim % 8 or cfg.model.head_dim > 256:
            raise ConfigError(f"model.attention=cudnn needs head_dim (d_model/heads={cfg.model.head_dim}) "
                              "a multiple of 8 and <= 256")
