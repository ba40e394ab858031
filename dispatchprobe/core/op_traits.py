"""What the pipeline knows about ops by name: one table, read by capture, the inline checks,
compare and run-ut alike (no framework import; adapters map their ops onto these names).

Names are *base names*: ``aten.add_.Tensor`` -> ``add`` (namespace, overload and the trailing
underscore of an in-place variant dropped), so one entry covers every variant of an op.
"""

from __future__ import annotations

import functools

from ..records import format as _format

base_name = functools.lru_cache(maxsize=8192)(_format.base_name)   # memoised: asked per op call


# Outputs depend on a random generator: never re-run by the inline checks, never replayed.
RANDOM = frozenset({
    "dropout", "native_dropout", "feature_dropout", "alpha_dropout", "feature_alpha_dropout", "bernoulli", "rand",
    "rand_like", "randn", "randn_like", "randint", "randint_like", "randperm", "normal", "uniform", "random",
    "exponential", "geometric", "cauchy", "log_normal", "multinomial", "rrelu", "rrelu_with_noise", "poisson",
    "_fused_dropout", "_standard_gamma", "_sample_dirichlet", "binomial",
    "_scaled_dot_product_flash_attention_for_cpu_dropout",
    # MindSpore's primitives (PyNative's pyboost ops and the older ones); DropoutDoMask applies a
    # mask it is given and draws nothing
    "Dropout", "Dropout2D", "Dropout3D", "DropoutExt", "Dropout2dExt", "FuncDropoutExt", "DropoutGenMask",
    "DropoutGenMaskExt", "Bernoulli", "BernoulliExt", "InplaceBernoulliScalar", "InplaceBernoulliTensor",
    "InplaceExponential", "InplaceNormal", "InplaceRandom", "InplaceUniform", "Multinomial", "MultinomialExt",
    "MultinomialWithReplacement", "NormalFloatFloat", "NormalFloatTensor", "NormalTensorFloat", "NormalTensorTensor",
    "RandExt", "RandInt", "RandIntLike", "RandLikeExt", "Randn", "RandnLike", "Randperm", "RandpermExt",
    "RandpermV2", "UniformExt", "UniformInt", "UniformReal", "StandardNormal", "StandardLaplace", "TruncatedNormal",
    "ParameterizedTruncatedNormal", "LogNormalReverse", "Cauchy", "Gamma", "RandomGamma", "Poisson",
    "RandomPoisson", "RandomCategorical", "RandomChoiceWithMask", "RandomShuffle", "UniformCandidateSampler",
    "LogUniformCandidateSampler"})

# Hand out memory without writing it: its contents are undefined until an op writes them.
UNINITIALISED = frozenset({"empty", "empty_like", "empty_strided", "empty_permuted", "new_empty",
                           "new_empty_strided"})

# Allocation and bookkeeping: outputs are uninitialised memory or metadata.  Never recorded by
# capture (their "values" differ between identical runs), nothing to check in run-ut.
NOTHING_TO_CHECK = UNINITIALISED | {"resize", "set", "record_stream", "_local_scalar_dense", "sym_size", "sym_stride",
                                    "sym_numel"}

# Only make a new alias of existing data (skipped by capture unless include_views=True).
ALIAS = frozenset({"detach", "alias", "lift_fresh", "lift", "_unsafe_view"})

# Write every element of their first argument without reading it: its old content (often
# uninitialised memory) is neither copied by capture nor compared.  ``_foreach_copy_`` writes each
# tensor of its first list (FSDP2's cast of the parameters into its all-gather buffer).
OVERWRITE = frozenset({"bernoulli", "uniform", "normal", "random", "exponential", "geometric", "cauchy",
                       "log_normal", "fill", "zero", "copy", "_foreach_copy"})

# Arguments ops write although their schemas do not say so (torch's ``Tensor(a!)``): base name ->
# argument names (torch) or input positions (MindSpore's primitives take positional inputs).
# Capture copies them before the op, as it does the marked ones, so that a record holds what the
# op received and a re-run never writes the training's tensors.  The torch adapter reads torch's
# own list too (``_SchemaInfo``: the batch-norm family's running statistics).
UNMARKED_WRITES = {
    "native_batch_norm": ("running_mean", "running_var"), "cudnn_batch_norm": ("running_mean", "running_var"),
    "miopen_batch_norm": ("running_mean", "running_var"),
    "BatchNorm": (3, 4),          # MindSpore: (x, scale, bias, mean, variance); the moving statistics
}

# Output buffers that ops fill without their schemas marking a write, and without reading what
# they held (torch's collectives take them as plain ``Tensor`` arguments): base name -> argument
# names.  The uninitialised-memory tracking counts them as written, and capture records them as
# the op left them (an all-gather's output buffer is ``empty`` memory until the all-gather).
UNMARKED_FILLS = {
    "_allgather_base": ("output_tensor",), "allgather": ("output_tensors",), "allgather_coalesced": ("output_lists",),
    "allgather_into_tensor_coalesced": ("outputs",), "_reduce_scatter_base": ("output_tensor",),
    "reduce_scatter": ("output_tensors",), "reduce_scatter_tensor_coalesced": ("outputs",),
    "alltoall": ("output_tensors",), "alltoall_base": ("output",), "gather": ("output_tensors",),
    "scatter": ("output_tensors",), "recv": ("tensors",), "recv_any_source": ("tensors",),
}

# Casts and copies, not compute: autocast adds them on one side only, autograd copies a
# gradient in one run and steals it in another.  compare lists them apart when unmatched.
CAST = frozenset({"_to_copy", "to", "copy", "_foreach_copy", "convert_element_type"})


# Read only their tensor inputs' shape, dtype and device, never their values: what they make is a
# constant of the program (``zeros_like(x)`` is zeros whatever x holds).  The ``_like``/``new_``
# random ops are in RANDOM instead.
METADATA_ONLY = frozenset({"zeros_like", "ones_like", "full_like", "new_zeros", "new_ones", "new_full",
                           "empty_like", "new_empty", "new_empty_strided"})


def reads_metadata_only(op: str) -> bool:
    return base_name(op) in METADATA_ONLY


# Add or subtract their operands element by element (torch's and MindSpore's names).  Two runs may
# group the terms of one accumulation differently (autograd sums a gradient in two groups where a
# cast splits the uses of a value), so their partial sums are no pair while the total is.
ELEMENTWISE_SUM = frozenset({"add", "sub", "rsub", "Add", "Sub", "AddExt", "SubExt"})


# Output elements of one input, picked (rows of an embedding, a gather, the largest of a top-k, a slice):
# the picked elements' statistics may move far more, or less, than the whole input's, so on statistics
# alone such an op adds no difference of its own beside an input that differs (torch's and MindSpore's
# names; slicing views where they are recorded).
SELECTS = frozenset({
    "embedding", "index_select", "gather", "take", "take_along_dim", "masked_select", "index", "topk",
    "kthvalue", "sort", "max", "min", "amax", "amin", "median", "nanmedian", "mode", "slice", "select",
    "narrow", "diagonal", "unfold", "as_strided", "slice_copy", "select_copy", "narrow_copy", "diagonal_copy",
    "unfold_copy", "as_strided_copy",
    "Embedding", "Gather", "GatherD", "GatherNd", "IndexSelect", "MaskedSelect", "TopK", "TopkExt", "Slice",
    "StridedSlice", "SliceExt", "SelectExt", "Narrow", "ArgMaxWithValue", "ArgMinWithValue", "MaxDim", "MinDim",
    "Sort", "SortExt"})


def selects(op: str) -> bool:
    return base_name(op) in SELECTS


# Output differs relatively no more than the inputs do, up to rounding: they scale, move or pick
# values and sum none that may cancel.  compare judges such an op present in one run only by how far
# what it hands on is off against what it was given; any other (a matrix product, a sum, another
# library's op) may hand a difference on many times larger.  torch's names, in-place forms included.
KEEPS_RELATIVE = frozenset({
    "mul", "div", "neg", "clone", "copy", "_to_copy", "to", "cat", "stack", "expand", "view", "reshape",
    "_unsafe_view", "permute", "transpose", "t", "squeeze", "unsqueeze", "slice", "select", "narrow", "split",
    "split_with_sizes", "chunk", "unbind", "index", "index_select", "gather", "where", "masked_fill", "repeat",
    "flip", "roll", "slice_backward", "select_backward", "alias", "detach", "contiguous"})


def keeps_relative(op: str) -> bool:
    """The op hands on a difference no larger, relatively, than it is given (:data:`KEEPS_RELATIVE`)."""
    return base_name(op).rstrip("_") in KEEPS_RELATIVE


# Jump where their float input crosses a threshold: piecewise constant (rounding, sign, counting into
# bins) or cut at every multiple of a divisor.  An input one ulp from a jump moves the output by a
# whole step, so how far their output moves when their inputs are nudged measures where the inputs
# lie, not precision (Mixtral counts tokens per expert with ``histc`` of the expert indices cast to
# float: 3.0 nudged above ``max=3`` leaves the histogram).  torch's and MindSpore's names.
STEPS = frozenset({
    "floor", "ceil", "round", "trunc", "fix", "sign", "sgn", "signbit", "heaviside", "frac", "fmod", "remainder",
    "floor_divide", "histc", "histogram", "histogramdd", "_histogramdd_from_bin_cts", "_histogramdd_from_bin_tensors",
    "bucketize", "searchsorted",
    "Floor", "Ceil", "Round", "Trunc", "Sign", "FloorDiv", "FloorMod", "Mod", "TruncateDiv", "TruncateMod",
    "Heaviside", "Histc", "HistcExt", "Bucketize", "SearchSorted"})


def steps(op: str) -> bool:
    """The op's output jumps where its float input crosses a threshold (:data:`STEPS`)."""
    return base_name(op) in STEPS


def is_random(op: str) -> bool:
    """The op draws random numbers; a region's label (``region(3 ops: aten.bernoulli_.float .. aten.mul.Tensor)``,
    ``region(Dropout)``: the ops two frameworks compute one value with) where it names such an op."""
    if op.startswith(REGION_LABEL):
        return any(base_name(o) in RANDOM for o in region_label_ops(op))
    return base_name(op) in RANDOM


REGION_LABEL = "region("


def region_label(ops: list) -> str:
    """The label of a region computed with ``ops``: its first and last, and every random op between
    (what :func:`is_random` reads of it)."""
    if len(ops) == 1:
        return f"{REGION_LABEL}{ops[0]})"
    named = [ops[0], *(o for o in ops[1:-1] if base_name(o) in RANDOM), ops[-1]]
    return f"{REGION_LABEL}{len(ops)} ops: {' .. '.join(named)})"


def region_label_ops(label: str) -> list:
    inner = label[len(REGION_LABEL):-1]
    return inner.split(": ", 1)[-1].split(" .. ")


def is_cast(op: str) -> bool:
    return base_name(op) in CAST


# Namespaces of the marks a program sets for profilers (``record_function``'s enter and exit, which
# FSDP2 and the optimizers set around their work): they compute nothing, so compare never names one
# as where a difference enters, nor places there a difference that enters elsewhere.
ANNOTATION_NAMESPACES = ("profiler.",)


def is_annotation(op: str) -> bool:
    return op.startswith(ANNOTATION_NAMESPACES)


def is_elementwise_sum(op: str) -> bool:
    return base_name(op) in ELEMENTWISE_SUM


def writes_in_place(op: str) -> bool:
    """An aten op of the in-place form (``add_``, ``mul_``): it writes into its first input."""
    parts = op.split(".")
    return len(parts) >= 3 and parts[0] == "aten" and parts[1].endswith("_")


def overwrites_first_input(op: str) -> bool:
    """The op writes its first argument in place without reading it (``copy_``, ``fill_``)."""
    return op.split(".")[1].endswith("_") if op.count(".") >= 1 and base_name(op) in OVERWRITE else False


def first_argument(arg: str) -> bool:
    """Record argument ``arg`` is an op's first argument, ``input.0``, or a tensor of it where it is a
    list (``input.0.1`` of ``_foreach_copy_``)."""
    return arg == "input.0" or arg.startswith("input.0.")


def overwritten(op: str, arg: str) -> bool:
    """Record argument ``arg`` is what the op overwrites without reading (:func:`overwrites_first_input`,
    :func:`first_argument`).  Its old content is no input: no value the op reads, no dtype it computes from."""
    return first_argument(arg) and overwrites_first_input(op)

# two-input ops whose inputs may be given in either order (another framework may swap them)
COMMUTATIVE = frozenset({"add", "mul", "maximum", "minimum", "eq", "ne", "logical_and", "logical_or", "bitwise_and",
                         "bitwise_or", "bitwise_xor"})

# Dynamic loss scaling (torch.amp.GradScaler and any code built on the same ops): the check that
# finds inf/nan in the unscaled gradients, and the scale update that backs off when it did.
LOSS_SCALE_CHECK = "_amp_foreach_non_finite_check_and_unscale"
LOSS_SCALE_UPDATE = "_amp_update_scale"
