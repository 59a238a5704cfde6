"""Typed run configuration: YAML file + dotted `key=value` overrides, validated up front.

One frozen dataclass per section. Every user mistake becomes a `ConfigError` whose message is
one line naming the key and the fix; entry points print it and exit non-zero *before* JAX
compiles anything. The checks (`validate`, run by `load_config`, and `check_runtime`, called
once the backend is known) live in `config_checks`, one function per concern.
"""

from __future__ import annotations

import dataclasses
import difflib
import keyword
import os
import types
import typing
from dataclasses import dataclass, field
from typing import Literal, Optional

import yaml

# The checks (config_checks.py): load_config validates, and callers import them from here.
from megascale_jax.config_checks import ConfigError, check_process_count, check_runtime, validate  # noqa: F401


@dataclass(frozen=True)
class MeshConfig:
    """Device mesh (dp, pp, cp, tp). tp is innermost (one host's NVLink domain), then cp, then pp,
    then dp."""

    dp: int = 1
    pp: int = 1
    tp: int = 1
    # Context parallelism: each sequence split into cp contiguous slices, one per rank; attention
    # fetches the previous ranks' keys/values it needs (parallel/context_parallel.py)
    cp: int = 1
    # Simulated XLA devices per process when running on the CPU. None (the default) follows the
    # mesh: dp*pp*cp*tp divided by the number of processes. Give a number only to pin it.
    cpu_devices: Optional[int] = None

    @property
    def size(self) -> int:
        return self.dp * self.pp * self.cp * self.tp

    @property
    def product(self) -> str:
        """The mesh's device count as the errors spell it: `dp*pp*tp=2*1*2=4` (cp named when > 1)."""
        axes = ("dp", "pp", "cp", "tp") if self.cp > 1 else ("dp", "pp", "tp")
        return f"{'*'.join(axes)}={'*'.join(str(getattr(self, a)) for a in axes)}={self.size}"

    def cpu_devices_per_process(self, process_count: int = 1) -> int:
        return self.cpu_devices if self.cpu_devices is not None else max(1, self.size // process_count)


@dataclass(frozen=True)
class ModelConfig:
    """Decoder-only transformer shape and numerics."""

    layers: int = 4
    d_model: int = 128
    heads: int = 4
    # Grouped-query attention when < heads. Split over mesh.tp when tp divides it; with fewer kv
    # heads than tp ranks (tp a multiple of kv_heads, e.g. 8 at tp=16) each is replicated over tp/kv_heads.
    kv_heads: int = 4
    mlp_ratio: float = 4.0
    vocab: int = 256
    seq_len: int = 128
    block: Literal["parallel", "serial"] = "parallel"
    window: Optional[int] = None  # sliding window: token sees itself + previous window-1; None = causal
    attention: Literal["xla", "cudnn", "pallas"] = "xla"
    norm: Literal["layernorm", "rmsnorm"] = "layernorm"
    norm_eps: Optional[float] = None  # None: 1e-5 for LayerNorm, 1e-6 for RMSNorm (HF layer_norm_eps / rms_norm_eps)
    # gelu / gelu_tanh: act(x W1 + b1) W2. swiglu: (silu(x Wg + bg) * (x W1 + b1)) W2, Llama's gated MLP.
    activation: Literal["gelu", "gelu_tanh", "swiglu"] = "gelu_tanh"
    # The MLP's hidden width. None: d_model * mlp_ratio, or for swiglu Llama's rule, 2/3 of that
    # rounded up to a multiple of 256 (11008 for d_model=4096), so the three matrices hold about
    # the parameters of the two of a GeLU MLP. An HF config's intermediate_size goes here.
    mlp_hidden: Optional[int] = None
    bias: bool = True  # biases on the q/k/v/output projections and the MLP (GPT-3, Phi); false: Llama, Mistral
    tied_embeddings: bool = False  # the LM head is the embedding's transpose (one matrix, both gradients)
    rope_base: float = 10000.0  # rotary frequencies base^(-2i/rotated dims) (HF rope_theta)
    rope_fraction: float = 1.0  # share of each head's dims rotated, the first ones (HF partial_rotary_factor)
    # A Hugging Face model directory (config.json + safetensors) whose weights a new run starts
    # from, on any mesh (megascale_jax/interop). The model keys above must match its config.json.
    init_from: Optional[str] = None
    dtype: Literal["float32", "bfloat16"] = "float32"  # compute dtype; parameters stay float32
    fused_norm: bool = False  # LayerNorm as the Pallas kernel (pallas_kernels.layer_norm)
    fused_mlp: bool = False  # MLP bias + GeLU as the Pallas kernel (pallas_kernels.bias_gelu)
    # What each layer's backward recomputes instead of storing (transformer.REMAT_POLICIES):
    # none stores what autodiff keeps (the GeLU and the norms keep only their inputs either way:
    # transformer.xla_bias_gelu, transformer.normalize); elementwise recomputes the norms and the MLP
    # activation from their inputs (transformer.elementwise: SwiGLU then keeps less); dots keeps
    # the matmul outputs and recomputes norms, GeLU and the attention softmax; full keeps only
    # each layer's input and reruns the layer.
    remat: Literal["none", "elementwise", "dots", "full"] = "none"
    # The loss in this many slices of the sequence: each slice's float32 logits are computed,
    # reduced to its cross entropy and dropped, and recomputed in the backward, so the step never
    # holds the whole (batch, seq, vocab) float32 logits (412 MB a sequence at vocab 50,304 and seq
    # 2,048). 1: the logits in one piece (transformer.chunked_cross_entropy)
    loss_chunks: int = 1
    # Layers the layer scan runs per loop iteration (jax.lax.scan's unroll; the parameters stay
    # stacked): 1 keeps one layer's code in the loop, `layers` unrolls the stack whole, as NVIDIA's
    # MaxText GPU recipes run (scan_layers=False), at the cost of compile time (gpt_1b for an H100:
    # 29 s against 8). With model.remat a rolled scan keeps less (gpt_1b, remat=full at 16
    # sequences, compiled for an H100: 31.5 GiB rolled, 36.4 unrolled)
    scan_unroll: int = 1
    # The LM head's backward GEMMs take the logits' gradient in float32 (autodiff of its float32-
    # accumulated forward) rather than in `dtype` as every other GEMM's backward does
    # (transformer.head_logits). Only matters at dtype=bfloat16; on an H200 the float32 weight-
    # gradient GEMM alone took 15.5 ms of a 340 ms step (2026-11-27)
    head_grad_float32: bool = False
    # The layers' four GEMMs as FP8 GEMMs (model/fp8.py: e4m3 values and weights, e5m2 gradients,
    # each scaled by its own amax in the step). The embedding, attention and the LM head stay in
    # `dtype`. Compiled for a GPU it must become cuBLASLt's FP8 GEMM (`plan --compile` counts them)
    fp8: bool = False
    # Packed documents kept apart (model/documents.py): the token that ends each document. Set, no
    # query attends to a key of another document of its sequence, and the target after this token
    # (the next document's first) is not trained on. data.source=jsonl|parquet set it to the
    # tokenizer's end-of-document token (data.keep_documents_apart). None: plain causal packing
    document_eos: Optional[int] = None
    rope_restart: bool = True  # with document_eos: rotary positions count from each document's start

    @property
    def head_dim(self) -> int:
        return self.d_model // self.heads

    @property
    def mlp_dim(self) -> int:
        if self.mlp_hidden is not None:
            return self.mlp_hidden
        width = self.d_model * self.mlp_ratio
        if self.activation == "swiglu":
            return -(-int(2 * width / 3) // 256) * 256
        return int(round(width))

    @property
    def mlp_up_matrices(self) -> int:
        """Matrices from d_model into the MLP's width: the up projection, and SwiGLU's gate."""
        return 2 if self.activation == "swiglu" else 1

    @property
    def epsilon(self) -> float:
        """The norms' epsilon: `norm_eps`, else the default of the norm."""
        return self.norm_eps if self.norm_eps is not None else (1e-5 if self.norm == "layernorm" else 1e-6)

    @property
    def rotary_dims(self) -> int:
        """Dims of each head that rotary positions rotate (HF: int(head_dim * partial_rotary_factor))."""
        return int(self.head_dim * self.rope_fraction)


@dataclass(frozen=True)
class ParallelConfig:
    """How the model is split and how communication is overlapped."""

    tp_overlap: Literal["none", "collective_matmul", "xla"] = "none"
    sequence_parallel: bool = False  # residual stream split over tp along the sequence between blocks
    tp_bidirectional: bool = True  # collective matmul: alternate pieces travel opposite ways round the ring
    tp_chunks: int = 2  # collective matmul: pieces each device's sequence shard is cut into (even if bidirectional)
    pp_schedule: Literal["gpipe", "1f1b", "interleaved_1f1b"] = "1f1b"
    pp_virtual: int = 1
    pp_stash: Literal["inputs", "residuals"] = "inputs"  # pipeline: recompute chunks from inputs, or keep vjp residuals
    microbatches: int = 1  # microbatches per global batch: pipeline microbatches, or gradient accumulation at pp=1
    zero1: bool = False  # shard optimizer state over dp (ZeRO-1)


@dataclass(frozen=True)
class OptimConfig:
    """Optimizer, learning-rate schedule (linear warmup, then a decay) and clipping."""

    name: Literal["lamb", "adamw"] = "lamb"
    lr: float = 3e-3
    warmup: int = 10
    # after warmup: cosine (to lr * min_lr_ratio at train.steps), linear (the same ends, a straight
    # line), or wsd (warmup-stable-decay: lr held, then a linear decay over the last decay_fraction
    # of train.steps)
    schedule: Literal["cosine", "linear", "wsd"] = "cosine"
    decay_fraction: float = 0.2  # schedule=wsd: the share of train.steps spent decaying
    min_lr_ratio: float = 0.1  # the learning rate at train.steps, as a share of lr
    weight_decay: float = 0.01  # masked off norms and biases
    clip: Optional[float] = 1.0  # global-norm clipping; None disables
    b1: float = 0.9
    b2: float = 0.95
    eps: float = 1e-6


@dataclass(frozen=True)
class TrainConfig:
    """Loop length, batch, seed and reporting cadence."""

    steps: int = 200
    global_batch: int = 16  # sequences per step, across all data-parallel replicas
    seed: int = 0
    log_every: int = 10
    eval_every: int = 50  # validation loss every N steps (0 = only at the end)
    eval_batches: int = 2  # 0 = no validation loss: nothing is compiled or run for it
    # Before compiling, compare flops.memory_estimate with the device's memory (GPU: its bytes
    # limit; CPU: the RAM available to the simulated devices) and refuse a config that cannot fit.
    memory_check: bool = True
    # Each step's input state gives its buffers to its output (jit donation): one state in memory,
    # not two. false only to measure what that saves (the GPU campaign's lever table).
    donate: bool = True
    # Keep compiled executables in RUN_DIR/compile_cache, so a restart loads them instead of
    # compiling (training/compile_cache.py; not used by a CPU job of several processes).
    compile_cache: bool = True
    # At the end of the run, print what the trained model writes after `sample_prompt`: this many
    # new tokens, sampled from a fixed seed (training/sample_at_end.py). 0 = off.
    sample_at_end: int = 0
    sample_prompt: str = "def "
    # Downstream tasks scored on the training mesh as lm-evaluation-harness scores them
    # (training/downstream.py; docs/evaluation.md): local task files, every `eval_tasks_every` steps
    # (0 = only at the end) and at the last step, logged in metrics.jsonl under "downstream".
    eval_tasks: tuple[str, ...] = ()
    eval_tasks_every: int = 0


@dataclass(frozen=True)
class DataConfig:
    """Where tokens come from. `stdlib`: this Python's own standard-library sources, byte-level."""

    source: Literal["stdlib", "files", "tokens", "jsonl", "parquet"] = "stdlib"
    # files: a glob of text files; tokens: a flat binary token file; jsonl/parquet: a glob of shards
    path: Optional[str] = None
    token_dtype: Literal["uint16", "uint32"] = "uint16"  # for source=tokens
    # jsonl/parquet (training/tokenized_corpus.py): each document the shard's `text_field`, encoded with
    # `tokenizer` (a tokenizer.json or a Hugging Face model directory) once, into `cache_dir`
    tokenizer: Optional[str] = None
    text_field: str = "text"
    eos: Optional[str] = None  # the end-of-document token, where the tokenizer does not say
    stop_at_bad_line: bool = False  # a bad JSONL line stops the run (default: skipped and counted)
    cache_dir: Optional[str] = None  # default ~/.cache/megascale_jax/tokenized
    tokenize_workers: int = 0  # processes tokenizing shards at once (0: one a core, at most one a shard)
    # jsonl/parquet: attention stays inside each packed document (model.document_eos set to the
    # tokenizer's end-of-document token); false: documents attend across their boundaries
    keep_documents_apart: bool = True
    # Several sources mixed by weight (training/mixture.py): a mapping of each source's path (what
    # data.path would be, for this data.source) to its weight, e.g. {'web/*.jsonl': 0.7,
    # 'code/*.jsonl': 0.3}; weights are normalised. Each source is packed, split and shuffled on
    # its own; every batch draws from them in the weights' proportions. Replaces data.path.
    mix: Optional[dict[str, float]] = None
    # jsonl/parquet (training/streaming.py): tokenize while training instead of into a cache file
    # before the first step. `readers` streams (null: chosen at the run's first start, then kept in
    # its config.yaml), each its shards in a seeded order per epoch, shuffled within windows of
    # `shuffle_window` sequences; a batch stays a pure function of (seed, step)
    stream: bool = False
    readers: Optional[int] = None
    shuffle_window: int = 1024
    val_fraction: float = 0.05  # share of sequences held out for validation (0: none, with train.eval_batches=0)
    prefetch: int = 2  # batches prepared ahead by a background thread (0 = synchronous)


@dataclass(frozen=True)
class CheckpointConfig:
    """Two-stage orbax checkpoints: `save()` blocks for the device->host copy, the write is async.

    `async` is a Python keyword, so the field is `async_`; the YAML/override key is `async`."""

    dir: Optional[str] = None  # default: RUN_DIR/checkpoints
    every: int = 100  # save every N steps and at the last step (0 = never)
    keep: int = 3  # newest committed checkpoints kept
    async_: bool = True
    single_replica_restore: bool = False  # one dp replica reads, the others receive by broadcast
    # Stage 1 becomes a copy of the state on the device (a memory-bandwidth copy: milliseconds),
    # and the device->host copy runs on a thread while training goes on. Costs the state's size
    # in device memory until the host holds it. On an H200 (2026-11-27) a 16 GB save blocked
    # 3.26 s of 15.4 s without it, 0.016 s of 9.9 s with it (host copy 51 GB/s). null (the
    # default): on where the devices are GPUs, off elsewhere (`with_device_defaults`).
    background_host_copy: Optional[bool] = None
    # At most this much of the state (GiB per device) copied on the device by a background save;
    # the rest goes to host memory while the step waits (a blocking copy at the host link's rate).
    # null: all of it where it fits beside the compiled step (on a GPU: jax's limit less the step's
    # peak), so a save never takes a run past the device's memory; 0: none on the device.
    device_copy_gib: Optional[float] = None
    # Every N steps each process copies its shards to a file in RAM (training/snapshot.py): a
    # restart resumes from the newest snapshot every process holds, if newer than the newest
    # checkpoint. Survives the process; with `peer_copy`, the machine too. Costs 3x this process's state in RAM.
    memory_every: int = 0  # 0 = off
    memory_dir: Optional[str] = None  # default: /dev/shm/megascale_jax-<user>/<hash of the run directory>
    # Each snapshot is also sent to a process on another host and held in its RAM, so a lost
    # machine's state comes back from that peer, not from disk (training/peer_copy.py). Costs one
    # more process's snapshots (3 steps) in each host's RAM; nothing with every process on one host.
    peer_copy: bool = True


@dataclass(frozen=True)
class SupervisorConfig:
    """Heartbeats and recovery (`python -m megascale_jax.launch`; in megascale_jax/supervise/,
    detect.py finds faults and policy.py decides what to do)."""

    heartbeat_s: float = 1.0  # every worker writes a heartbeat record this often
    hang_timeout_s: float = 10.0  # no heartbeat for this long = hung (heartbeat silence only)
    # No step progress while heartbeats go on for this long = stalled: a floor of its own, so that
    # silence can be called sooner than a slow step (a hang is SIGSTOP-like and beats nothing).
    stall_floor_s: Optional[float] = None  # None: hang_timeout_s
    # A step is stalled once it has taken this many times the rank's recent median step (if that is
    # longer than stall_floor_s): a slow phase or a model with long steps is no stall.
    stall_steps: float = 5.0
    max_restarts: int = 3  # recoveries before the driver gives up with a report
    straggler_check_s: float = 10.0  # the driver runs the straggler statistic on the timings this often (0 = never)
    evict_stragglers: bool = False  # a flagged straggler is a fault: its slot is excluded, a spare takes over
    # A faulty rank excluded with no spare left (launch --spares): resume on fewer data-parallel
    # replicas with more microbatches (same global batch), or give up with the report.
    on_no_spare: Literal["shrink", "stop"] = "shrink"


@dataclass(frozen=True)
class ObserveConfig:
    """Per-step phase timings, TensorBoard scalars and straggler detection (megascale_jax/observe/timings.py)."""

    timings: bool = True  # RUN_DIR/timings/: per-process, per-step phase durations
    tensorboard: bool = True  # RUN_DIR/tensorboard/: loss, lr, grad norm, MFU, tokens/s, step time
    straggler_threshold: float = 0.05  # a rank this much slower than the median of its peers is flagged
    straggler_window: int = 20  # steps in the sliding window of the straggler statistic
    # Every N steps one step runs synchronously under jax.profiler; each device's compute, collective
    # and span seconds go to the timings (device rows) and the report's device heat map. 0 = off.
    profile_every: int = 0


@dataclass(frozen=True)
class Config:
    mesh: MeshConfig = field(default_factory=MeshConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    data: DataConfig = field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    supervisor: SupervisorConfig = field(default_factory=SupervisorConfig)
    observe: ObserveConfig = field(default_factory=ObserveConfig)

    def to_dict(self) -> dict:
        # Fields named after Python keywords carry a trailing "_"; the config key has none.
        return {section: {_key_name(k): list(v) if isinstance(v, tuple) else v for k, v in values.items()}
                for section, values in dataclasses.asdict(self).items()}


def _key_name(field_name: str) -> str:
    return field_name[:-1] if keyword.iskeyword(field_name[:-1]) else field_name


DEFAULT_CONFIG_PATH = os.path.join(os.path.dirname(os.path.dirname(__file__)), "configs", "tiny_cpu.yaml")


# ----------------------------------------------------------------------------- loading


def _yaml_problem(e: yaml.YAMLError) -> str:
    """PyYAML's error as one line with where it is: `line 3, column 12: expected ',' or ']', but
    got '<stream end>'` (lines and columns counted from 1, as editors do)."""
    mark = getattr(e, "problem_mark", None)
    problem = getattr(e, "problem", None) or str(e).splitlines()[0]
    context = getattr(e, "context", None)
    what = f"{problem} ({context})" if context else problem
    return f"line {mark.line + 1}, column {mark.column + 1}: {what}" if mark else what


def load_config(path: Optional[str] = None, overrides: typing.Sequence[str] = (), *,
                planning: bool = False) -> Config:
    """Read YAML (`path`, default configs/tiny_cpu.yaml), apply `a.b=value` overrides, validate.

    `planning=True` checks only what sizing arithmetic needs (`python -m megascale_jax.flops`
    plans meshes the trainer cannot run yet and needs no data)."""
    path = path or DEFAULT_CONFIG_PATH
    try:
        with open(path) as f:
            raw = yaml.safe_load(f) or {}
    except OSError as e:
        raise ConfigError(f"cannot read config file {path!r}: {e.strerror}; pass an existing --config")
    except yaml.YAMLError as e:
        raise ConfigError(f"config file {path!r} is not valid YAML: {_yaml_problem(e)}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"config file {path!r} is not text (not UTF-8): pass a YAML config") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"config file {path!r} must be a mapping of sections (mesh:, model:, ...)")
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep or "." not in key or not all(key.split(".")):
            raise ConfigError(f"override {item!r} must look like section.key=value, e.g. mesh.dp=2")
        *sections, leaf = key.split(".")
        node = raw
        for s in sections:
            node = node.setdefault(s, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override {item!r}: {s!r} is not a section")
        try:
            node[leaf] = yaml.safe_load(value) if value != "" else None
        except yaml.YAMLError as e:
            raise ConfigError(f"override {item!r}: the value is not valid YAML ({_yaml_problem(e)}); "
                              "write it as YAML, quoted for the shell (a mapping: data.mix='{\"a/*.jsonl\": 0.7}')") from None
    cfg = from_dict(raw)
    validate(cfg, planning=planning)
    return cfg


def from_dict(raw: dict) -> Config:
    """Build a Config from nested dicts, rejecting unknown keys and wrong types."""
    sections = {}
    for f in dataclasses.fields(Config):
        sections[f.name] = f.type
    for name in raw:
        if name not in sections:
            raise ConfigError(f"unknown config section {name!r}{_suggest(name, sections)}")
    built = {}
    for f in dataclasses.fields(Config):
        cls = typing.get_type_hints(Config)[f.name]
        values = raw.get(f.name) or {}
        if not isinstance(values, dict):
            raise ConfigError(f"config section {f.name!r} must be a mapping of keys")
        built[f.name] = _build_section(f.name, cls, values)
    return Config(**built)


def _build_section(section: str, cls: type, values: dict):
    hints = {_key_name(name): (name, hint) for name, hint in typing.get_type_hints(cls).items()}
    kwargs = {}
    for key, value in values.items():
        if key not in hints:
            raise ConfigError(f"unknown config key {section}.{key}{_suggest(key, hints, prefix=section + '.')}")
        name, hint = hints[key]
        kwargs[name] = _coerce(f"{section}.{key}", hint, value)
    return cls(**kwargs)


def _coerce(name: str, hint, value):
    """Check `value` against the annotated type; only lossless conversions are applied."""
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        if value is None:
            return None
        return _coerce(name, args[0], value)
    if origin is Literal:
        choices = typing.get_args(hint)
        if value not in choices:
            raise ConfigError(f"{name}={value!r} is not one of {', '.join(map(str, choices))}")
        return value
    if origin is tuple:  # a list in YAML; one string is a list of one
        item_type = typing.get_args(hint)[0]
        items = [value] if isinstance(value, str) else value
        if not isinstance(items, (list, tuple)):
            raise ConfigError(f"{name} must be a list (e.g. [a.jsonl, b.yaml]), got {value!r}")
        return tuple(_coerce(f"{name}[{i}]", item_type, v) for i, v in enumerate(items))
    if origin is dict:
        key_type, value_type = typing.get_args(hint)
        if not isinstance(value, dict) or not value:
            raise ConfigError(f"{name} must be a mapping (e.g. {{'a/*.jsonl': 0.7, 'b/*.jsonl': 0.3}}), got {value!r}")
        return {_coerce(f"{name} key", key_type, k): _coerce(f"{name}[{k!r}]", value_type, v) for k, v in value.items()}
    if hint is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{name} must be true or false, got {value!r}")
    if hint is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise ConfigError(f"{name} must be an integer, got {value!r}")
    if hint is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):  # YAML 1.1 reads "3e-4" as a string
            try:
                return float(value)
            except ValueError:
                pass
        raise ConfigError(f"{name} must be a number, got {value!r}")
    if hint is str:
        if isinstance(value, str):
            return value
        raise ConfigError(f"{name} must be a string, got {value!r}")
    raise TypeError(f"unsupported config annotation {hint} for {name}")


def _suggest(key: str, candidates, prefix: str = "") -> str:
    close = difflib.get_close_matches(key, list(candidates), n=1, cutoff=0.5)
    return f"; did you mean {prefix}{close[0]}?" if close else f"; valid keys: {', '.join(candidates)}"


def with_device_defaults(cfg: Config, backend: str) -> Config:
    """`cfg` with the settings whose default depends on the devices (null in the config) decided
    for JAX backend `backend`: checkpoint.background_host_copy on for GPUs."""
    if cfg.checkpoint.background_host_copy is not None:
        return cfg
    checkpoint = dataclasses.replace(cfg.checkpoint, background_host_copy=backend == "gpu")
    return dataclasses.replace(cfg, checkpoint=checkpoint)


def save_config(cfg: Config, path: str) -> None:
    with open(path, "w") as f:
        yaml.safe_dump(cfg.to_dict(), f, sort_keys=False)
