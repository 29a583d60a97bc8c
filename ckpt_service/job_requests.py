"""One request model per job kind: its options, their types, limits, defaults and command-line flags.

These models are the single source of each option: the offline commands (`ckptctl convert ...`) and
`ckptctl submit ...` generate their flags from them, `ckptctl submit` sends `model_dump()`, the REST
schema's `options` object is derived from them (`jobs.JobOptions`), and each kind's declaration
(`job_kinds`) pairs its model with its engine call. `shape` is the one reading of an option's annotation
(flag type, form widget, whether null is allowed).

Key clean-up defaults: `convert` keeps keys exactly as stored, `export` cleans them (a serving
checkpoint), `verify` compares cleaned names, and `reshard` leaves it to the engine (`clean_keys: null`:
kept with `only: all`, a training state restored as it was saved, cleaned otherwise).
"""

from __future__ import annotations

import types
from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated, Any, ClassVar, Literal, Union, get_args, get_origin

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
    ValidatorFunctionWrapHandler,
    WrapValidator,
)
from pydantic.fields import FieldInfo

from converters import DEFAULT_MEMORY_LIMIT, DEFAULT_SHARD_SIZE, READERS, CkptError, dtypes

from .units import parse_size

if TYPE_CHECKING:
    #: A reader name. Formats are registered at run time (`converters.register_format`), so to a type checker
    #: a format is a string; the schema and validation see the Literal of the names registered at import.
    Format = str
else:
    #: The engine's reader names, in its order (`converters.formats.READERS`).
    Format = Literal[tuple(READERS)]


def one_of(values: Any, what: str) -> WrapValidator:
    """The validator of a Literal `values` whose refusal names what it is and the choices (`unknown format
    'zarr'; choose one of ...`): `Annotated[Format, one_of(Format, "format")]`."""
    choices = ", ".join(get_args(values))

    def check(value: Any, handler: ValidatorFunctionWrapHandler) -> Any:
        try:
            return handler(value)
        except ValidationError:
            raise ValueError(f"unknown {what} {value!r}; choose one of {choices}") from None

    return WrapValidator(check)


Text = Annotated[str, Field(min_length=1, max_length=1024)]
Texts = Annotated[list[Text], Field(max_length=256)]


@dataclass(frozen=True)
class Flag:
    """How an option is spelled on the command line (`ckptctl KIND` and `ckptctl submit KIND`): its
    declarations, the placeholder its value shows in help (`GLOB`; choices are listed without one), and for
    a switch whose default is unset, what unset means, in words."""

    decls: tuple[str, ...]
    metavar: str | None = None
    unset: str | None = None


def flag(*decls: str, metavar: str | None = None, unset: str | None = None) -> Flag:
    return Flag(decls, metavar, unset)


def dtype_name(value: Any) -> Any:
    """A dtype's other spellings (bf16, fp16, half, float, torch.bfloat16: `dtypes.canonical`) as its name."""
    try:
        return dtypes.canonical(value) if isinstance(value, str) else value
    except CkptError:
        return value  # refused below, with the choices


def _size(value: int | str) -> int:
    try:
        size = parse_size(value)
    except Exception:
        raise ValueError("write a number of bytes or a size such as 5GB or 256MiB") from None
    if size <= 0:
        raise ValueError("must be positive")
    return size


Size = Annotated[int | str, AfterValidator(_size)]

SourceFormat = Annotated[Annotated[Format, one_of(Format, "format")] | None,
                         Field(description=f"Force the source format ({', '.join(READERS)})."),
                         flag("--from", metavar="FORMAT")]
Selection = Literal["model", "optim", "all"]
Only = Annotated[Selection, one_of(Selection, "selection"),
                 Field(description="Which entries: model, optim or all."), flag("--only")]
CleanKeys = Annotated[bool | None, Field(description="Strip wrapper prefixes and containers from names, or keep "
                                         "names exactly as stored."),
                      flag("--clean-keys/--keep-keys", unset="names kept for --only all, cleaned otherwise")]
Rename = Annotated[Texts, Field(description="REGEX=REPLACEMENT applied to parameter names, in order."),
                   flag("--rename", metavar="REGEX=REPLACEMENT")]
Include = Annotated[Texts, Field(description="Keep only names matching this glob."), flag("--include", metavar="GLOB")]
Exclude = Annotated[Texts, Field(description="Drop names matching this glob."), flag("--exclude", metavar="GLOB")]
#: The engine's cast targets (`converters.dtypes.CAST_TARGETS` is derived from it).
CastTarget = dtypes.CastTarget
DType = Annotated[Annotated[CastTarget, one_of(CastTarget, "dtype")] | None, BeforeValidator(dtype_name),
                  Field(description=f"Cast floating-point tensors: {', '.join(dtypes.CAST_TARGETS)} (also bf16, "
                                    "fp16, half, fp32, float)."), flag("--dtype")]
ShardSize = Annotated[Size, Field(description="Largest safetensors shard: bytes, or a size such as 5GB."),
                      flag("--max-shard-size", metavar="SIZE")]
MemoryLimit = Annotated[Size, Field(description="Cap on tensor bytes held in memory: bytes, or a size such as "
                                    "256MiB."), flag("--memory-limit", metavar="SIZE")]
Overwrite = Annotated[bool, Field(description="Replace an existing target."), flag("--overwrite")]
DropTied = Annotated[Texts, Field(description="Leave out NAME, a tensor equal to another (e.g. lm_head.weight); "
                                  "the tie is recorded."), flag("--drop-tied", metavar="NAME")]
VerifyOutput = Annotated[bool, Field(description="Compare the output with the source before finishing."),
                         flag("--verify")]
CertifyStats = Annotated[bool, Field(description="Put the statistics of source and output side by side in the "
                                               "output's certificate (checked: equal, or within a cast's rounding)."),
                         flag("--stats")]
RequireFinite = Annotated[bool, Field(description="Scan the source first and write nothing when a tensor holds NaN "
                                                  "or Inf (a guard for rules: a diverged step is never exported)."),
                          flag("--require-finite")]


def _bound(value: str) -> str:
    from converters import parse_bounds

    try:
        parse_bounds([value])
    except CkptError as exc:
        raise ValueError(str(exc)) from None
    return value.strip()


#: one bound on a scan's statistics (`converters.stats.guards`: finite, max_abs<=100, l2<=1e4:*.weight)
BoundText = Annotated[str, Field(min_length=1, max_length=300), AfterValidator(_bound)]
Require = Annotated[list[BoundText], BeforeValidator(lambda value: [value] if isinstance(value, str) else value),
                    Field(max_length=32, description="Scan the source first and write nothing unless every bound "
                                                     "holds: finite, or STAT<=LIMIT[:GLOB] / STAT>=LIMIT[:GLOB] with "
                                                     "STAT max_abs, l2 or std (e.g. max_abs<=100, l2<=1e4:*.weight)."),
                    flag("--require", metavar="BOUND")]
Tag = Annotated[str | None, Field(max_length=200, description="DeepSpeed: the tag folder to read (default: the one "
                                  "`latest` names)."), flag("--tag", metavar="TAG")]
WeightsChoice = Literal["fp32", "module"]
Weights = Annotated[Annotated[WeightsChoice, one_of(WeightsChoice, "weights")] | None,
                    Field(description="DeepSpeed: fp32 (the master weights, the default) or module (the 16-bit "
                                      "module weights)."), flag("--weights")]
OutputFormat = Literal["safetensors", "torch"]
#: `converters.hf_families` CHOICES: auto (the checkpoint's own config picks) or a family of the table
HFArchitecture = Literal["auto", "llama", "qwen2", "qwen3", "mistral", "mixtral", "qwen3_moe", "gemma2", "gemma3",
                         "deepseek_v3"]
ShardLayout = Literal["fsdp2"]
ImportTarget = Literal["megatron", "dcp"]
OutputLayout = Literal["auto", "flat"]
#: FP8 schemes of `converters.export_fp8` (llm-compressor's FP8_DYNAMIC, FP8_BLOCK, FP8_TENSOR), as flag values
QuantizeChoice = Literal["fp8-dynamic", "fp8-block", "fp8-tensor"]


#: GGUF tensor types of `converters.export_gguf` (llama.cpp's --outtype names)
GgufType = Literal["f32", "f16", "bf16", "q8_0"]


def lower_case(value: Any) -> Any:
    return value.strip().lower() if isinstance(value, str) else value


def scheme_spelling(value: Any) -> Any:
    """llm-compressor's spelling of a scheme (FP8_BLOCK) as the flag's (fp8-block)."""
    return value.strip().lower().replace("_", "-") if isinstance(value, str) else value


class JobRequest(BaseModel):
    """Options of one job kind (the `options` object of a job of that kind)."""

    # validators are built on first use: a command line builds only its own kind's
    model_config = ConfigDict(extra="forbid", defer_build=True)
    #: the kind's name and whether it takes a target, set by its declaration (`job_kinds.declare`)
    kind: ClassVar[str]
    takes_target: ClassVar[bool] = True


class SourceRequest(JobRequest):
    """A kind that reads one checkpoint: how to read it when detection is not enough."""

    source_format: SourceFormat = None
    tag: Tag = None
    weights: Weights = None


class KeyedRequest(JobRequest):
    """A kind that selects and renames keys."""

    only: Only = "all"
    clean_keys: CleanKeys = False
    rename: Rename = Field(default_factory=list)
    include: Include = Field(default_factory=list)
    exclude: Exclude = Field(default_factory=list)


class WritingRequest(JobRequest):
    """A kind that converts one checkpoint into a written output: the cast, memory, overwrite, the checks after
    (verify) and before (guards), and the certificate's statistics."""

    dtype: DType = None
    memory_limit: MemoryLimit = DEFAULT_MEMORY_LIMIT
    overwrite: Overwrite = False
    verify: VerifyOutput = False
    require_finite: RequireFinite = False
    require: Require = Field(default_factory=list)
    stats: CertifyStats = False


class OutputRequest(WritingRequest, KeyedRequest, SourceRequest):
    """A kind that reads one checkpoint and writes it out as safetensors or torch files (convert, export)."""

    max_shard_size: ShardSize = DEFAULT_SHARD_SIZE
    drop_tied: DropTied = Field(default_factory=list)


class ConvertRequest(OutputRequest):
    """Convert a checkpoint to one safetensors/torch output (model and optimizer, keys as they are)."""

    to: Annotated[OutputFormat, one_of(OutputFormat, "output format"),
                  Field(description="Output format: safetensors or torch."), flag("--to")] = "safetensors"


class ExportRequest(OutputRequest):
    """Export model weights to HF-style sharded safetensors for serving (clean keys, never optimizer state)."""

    only: Annotated[Selection, one_of(Selection, "selection"),
                    Field(description="model (an export never holds optimizer state)."), flag("--only")] = "model"
    clean_keys: CleanKeys = True
    to_hf: Annotated[Annotated[HFArchitecture, one_of(HFArchitecture, "architecture")] | None,
                     Field(description="Map a Megatron / NeMo GPT model to a Hugging Face architecture (auto: the "
                                       "one its config names) and write its config.json."), flag("--to-hf")] = None
    config_from: Annotated[Annotated[str, Field(min_length=1, max_length=4096)] | None,
                           Field(description="Folder to take config.json, generation config and tokenizer files "
                                             "from (default: the checkpoint's folder, its context/ and the two "
                                             "folders above it)."), flag("--config-from")] = None
    quantize: Annotated[Annotated[QuantizeChoice, one_of(QuantizeChoice, "quantization")] | None,
                        BeforeValidator(scheme_spelling),
                        Field(description="Quantize Linear weights to FP8 in the compressed-tensors layout vLLM "
                                          "loads: fp8-dynamic (per-channel), fp8-block (128x128 blocks) or fp8-tensor "
                                          "(llm-compressor's FP8_DYNAMIC, FP8_BLOCK, FP8_TENSOR)."),
                        flag("--quantize")] = None
    ignore: Annotated[Texts, Field(description="With quantize: Linear modules kept in their dtype (a module name, "
                                               "or re:REGEX)."),
                      flag("--ignore", metavar="MODULE")] = Field(default_factory=lambda: ["lm_head"])
    adapter_only: Annotated[bool, Field(description="Write only the checkpoint's LoRA adapter, as a PEFT folder "
                                                    "(adapter_model.safetensors, adapter_config.json)."),
                            flag("--adapter-only")] = False
    merge_adapter: Annotated[bool, Field(description="Merge the checkpoint's LoRA adapter into its base, as PEFT's "
                                                     "merge_and_unload() does, and write the merged model."),
                             flag("--merge-adapter")] = False
    gguf: Annotated[Annotated[GgufType, one_of(GgufType, "GGUF type")] | None, BeforeValidator(lower_case),
                    Field(description="Write one GGUF file for llama.cpp with this tensor type for the weights: f32, "
                                      "f16, bf16 or q8_0 (llama.cpp's convert_hf_to_gguf.py --outtype)."),
                    flag("--gguf", metavar="TYPE")] = None
    base: Annotated[Annotated[str, Field(min_length=1, max_length=4096)] | None,
                    Field(description="With merge_adapter: the base model's HF folder (default: the base weights "
                                      "stored with the adapter)."), flag("--base", metavar="DIR")] = None


class ReshardRequest(WritingRequest, KeyedRequest, SourceRequest):
    """Write a DCP checkpoint laid out for WORLD_SIZE ranks (FSDP2 loads it with dcp.load)."""

    world_size: Annotated[int, Field(ge=1, le=65536, description="Target ranks."), flag("--world-size", metavar="N")]
    layout: Annotated[ShardLayout, one_of(ShardLayout, "layout"),
                      Field(description="Sharding policy: fsdp2 (dim-0 torch.chunk pieces)."),
                      flag("--layout")] = "fsdp2"
    shard_dim_rule: Annotated[Texts, Field(description="REGEX=DIM: split matching parameters on DIM instead."),
                              flag("--shard-dim-rule", metavar="REGEX=DIM")] = Field(default_factory=list)
    only: Annotated[Selection, one_of(Selection, "selection"),
                    Field(description="Which entries: all (the whole training state as stored, to resume "
                                      "training), model or optim."), flag("--only")] = "all"
    clean_keys: CleanKeys = None
    dtype_optim: Annotated[bool, Field(description="Cast optimizer state too."), flag("--dtype-optim")] = False
    output_layout: Annotated[OutputLayout, one_of(OutputLayout, "output layout"),
                             Field(description="auto: the source framework's own folder layout (Accelerate, "
                                               "Lightning, Megatron), so its resume call works; flat: one DCP "
                                               "folder."),
                             flag("--output-layout")] = "auto"


class CompareRequest(KeyedRequest):
    """What verify and diff share: the key clean-up, tolerances and formats of the two sides."""

    only: Only = "all"
    clean_keys: CleanKeys = True
    atol: Annotated[float, Field(ge=0, le=1e6, description="Absolute tolerance (for cast outputs)."),
                    flag("--atol")] = 0.0
    rtol: Annotated[float, Field(ge=0, le=1e6, description="Relative tolerance (for cast outputs)."),
                    flag("--rtol")] = 0.0
    source_format: Annotated[Annotated[Format, one_of(Format, "format")] | None,
                             Field(description=f"Force the format of the first checkpoint (A): {', '.join(READERS)}."),
                             flag("--from-a", metavar="FORMAT")] = None
    target_format: Annotated[Annotated[Format, one_of(Format, "format")] | None,
                             Field(description="Force the format of the second checkpoint (B): the same choices."),
                             flag("--from-b", metavar="FORMAT")] = None
    memory_limit: MemoryLimit = DEFAULT_MEMORY_LIMIT


class VerifyRequest(CompareRequest):
    """Compare two checkpoints tensor by tensor (exact unless atol/rtol)."""

    certificate: Annotated[bool, Field(description="Re-check output A against the certificate in its manifest (its "
                                       "files, tensors and, when still there, the source ranges it names); B is "
                                       "not used."), flag("--certificate")] = False


class InspectRequest(SourceRequest):
    """Describe a checkpoint from its metadata alone (no tensor data is read, unless stats)."""

    tensors: Annotated[bool, Field(description="Include the tensor table."), flag("--tensors")] = False
    stats: Annotated[bool, Field(description="Also read every tensor for its statistics (as scan does)."),
                     flag("--stats")] = False


class ScanRequest(KeyedRequest, SourceRequest):
    """Read every tensor once for its statistics: NaN, +Inf, -Inf and zero counts, min, max, mean, std, L2 norm."""

    clean_keys: CleanKeys = True
    memory_limit: MemoryLimit = DEFAULT_MEMORY_LIMIT


class ScrubRequest(JobRequest):
    """Re-read a stored output and compare it with its recorded checksums (its manifest's file CRC-32s and its
    certificate's tensor CRC-32s); a mismatch names the file and byte range and marks the checkpoint `damaged`."""

    memory_limit: MemoryLimit = DEFAULT_MEMORY_LIMIT


ArchiveId = Annotated[str, Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$",
                                 description="The archive's id in the store.")]


class ArchiveRequest(JobRequest):
    """Keep a checkpoint in an archive store (the target: a folder or URI): content-addressed chunks, stored once
    across every checkpoint there and losslessly compressed; the registry records it with its stored bytes."""

    archive_id: Annotated[ArchiveId | None, Field(description="The archive's id (default: a hash of its content)."),
                          flag("--id", metavar="ID")] = None


class RestoreRequest(JobRequest):
    """Write an archived checkpoint (archive_id in the store given as source) back to the target, byte for byte,
    every chunk's hash checked; registered as a checkpoint restored from the archived one."""

    archive_id: Annotated[ArchiveId, flag("--id", metavar="ID")]


class ImportRequest(JobRequest):
    """Write a Hugging Face model folder as a Megatron-LM torch_dist save (release/), which megatron-core's
    dist_checkpointing.load reads at any TP/PP/EP, to start a Megatron run from it; or (into dcp, `--to dcp`) as a
    DCP folder under the names a FSDP2-wrapped transformers model's state_dict has, to start an FSDP2 run. (`into`,
    not `to`: the job options share one namespace, where `to` is convert's output format.)"""

    family: Annotated[Annotated[HFArchitecture, one_of(HFArchitecture, "architecture")],
                      Field(description="The model family of the mapping table (auto: the one config.json's "
                                        "model_type names)."), flag("--family")] = "auto"
    into: Annotated[Annotated[ImportTarget, one_of(ImportTarget, "import target")],
                    Field(description="megatron: a Megatron-LM torch_dist save; dcp: a torch.distributed.checkpoint "
                                      "folder for FSDP2 (the HF names, config.json beside it)."),
                    flag("--to")] = "megatron"
    world_size: Annotated[int | None, Field(ge=1, le=65536, description="With into dcp: the FSDP2 ranks it is laid "
                                                                        "out for (default 1; dcp.load reads it at "
                                                                        "any world size)."),
                          flag("--world-size", metavar="N")] = None
    memory_limit: MemoryLimit = DEFAULT_MEMORY_LIMIT
    overwrite: Overwrite = False


class DiffRequest(CompareRequest):
    """Compare two checkpoints of any formats tensor by tensor: identical or not, max |a-b|, relative L2 change,
    by layer (what moved most, what did not move)."""


def __getattr__(name: str) -> Any:
    """`REQUESTS` (each kind's request model) and `APPLIES` (which options each kind takes; setting another is
    a 422 naming the option), derived from the kinds' declarations (`job_kinds`) when first asked for."""
    if name == "REQUESTS":
        from .job_kinds import kinds

        return {kind.name: kind.request for kind in kinds().values()}
    if name == "APPLIES":
        from .job_kinds import kinds

        return {kind.name: frozenset(kind.request.model_fields) for kind in kinds().values()}
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def plain(annotation: Any) -> Any:
    """`annotation` without its Annotated layers, unions flattened: `Annotated[Literal[...], v] | None` is
    `Literal[...] | None`."""
    if get_origin(annotation) is Annotated:
        return plain(get_args(annotation)[0])
    if get_origin(annotation) in (Union, types.UnionType):
        members: list[Any] = []
        for arg in get_args(annotation):
            inner = plain(arg)
            for member in get_args(inner) if get_origin(inner) in (Union, types.UnionType) else (inner,):
                if member not in members:
                    members.append(member)
        return Union[tuple(members)]  # noqa: UP007 (built at run time)
    return annotation


@dataclass(frozen=True)
class Shape:
    """What an option's value is, as a form or a command line asks for it: `kind` is bool, int, float, list
    (of text), choice (one of `choices`) or text (anything else: sizes, paths, patterns); `optional` when
    null (unset) is allowed."""

    kind: Literal["bool", "int", "float", "list", "choice", "text"]
    optional: bool = False
    choices: tuple[Any, ...] = ()


_SIMPLE: dict[Any, Literal["bool", "int", "float"]] = {bool: "bool", int: "int", float: "float"}


def shape(annotation: Any) -> Shape:
    """The one reading of an option's annotation (the CLI's flags, the dashboard's widgets and the REST
    options object all use it)."""
    annotation = plain(annotation)
    args = get_args(annotation) if get_origin(annotation) in (Union, types.UnionType) else (annotation,)
    optional = type(None) in args
    inner = [a for a in args if a is not type(None)]
    if len(inner) == 1:
        value = inner[0]
        if get_origin(value) is Literal:
            return Shape("choice", optional, get_args(value))
        if get_origin(value) is list:
            return Shape("list", optional)
        simple = _SIMPLE.get(value)
        if simple is not None:
            return Shape(simple, optional)
    return Shape("text", optional)


def default_of(info: FieldInfo) -> Any:
    """A field's default (PydanticUndefined when it is required). A factory (here always a plain one, such
    as `list`) is called directly: pydantic's `get_default` first inspects its signature, which costs the
    command line's start-up."""
    return info.default_factory() if info.default_factory is not None else info.default  # type: ignore[call-arg]  # a factory that takes the data is never used here


def shared_default(name: str) -> Any:
    """Option `name`'s default where every kind that takes it agrees on one, else None (the kind decides)."""
    from .job_kinds import kinds

    defaults = [k.request.model_fields[name] for k in kinds().values() if name in k.request.model_fields]
    values = [None if f.is_required() else default_of(f) for f in defaults]
    return values[0] if all(v == values[0] for v in values) else None


def flag_of(model: type[JobRequest], name: str) -> Flag:
    """The command-line spelling of option `name` (every field has one; a test checks)."""
    for item in model.model_fields[name].metadata:
        if isinstance(item, Flag):
            return item
    raise LookupError(f"{model.__name__}.{name} has no command-line flag")


def problems(error: ValidationError, prefix: str = "") -> list[tuple[str, str]]:
    """(field, message) for each problem in `error`; the input is never echoed."""
    found = []
    for item in error.errors():
        name = ".".join(str(p) for p in item["loc"]) or "options"
        message = "required" if item["type"] == "missing" else str(item["msg"]).removeprefix("Value error, ")
        found.append((f"{prefix}{name}", message))
    return found


def build(kind: str, values: dict[str, Any]) -> JobRequest:
    """The request model of `kind` from option values; None values take the kind's defaults."""
    from .job_kinds import kind_of

    return kind_of(kind).request.model_validate({k: v for k, v in values.items() if v is not None})
