"""
    FusedCE

Julia interface to libfusedce, fused kernels for the losses at the end of a language model.

Layout convention (Julia is column-major, the library row-major): **a C tensor `[A, B]` is a Julia
`B×A` matrix**, i.e. the library's rows are Julia's columns.

| C argument            | Julia argument                                  |
|:----------------------|:------------------------------------------------|
| logits `[N, V]`       | `V×N` matrix, one column per token               |
| targets `[N]`         | `Vector` of **1-based** class indices            |
| hidden `[N, H]`       | `H×N` matrix                                     |
| weight `[V, H]`       | `H×V` matrix (a Flux `Embedding` weight as is; a `Dense(H=>V)` weight needs `permutedims`) |
| weight shard `[V_local, H]` | `H×V_local` matrix, columns `vocab_start+1 : vocab_start+V_local` of the `H×V` weight (`linear_cross_entropy_partial`) |
| top-K ids `[N, K]`    | `K×N` matrix of 1-based ids; an id ≤ 0 marks an unused slot |
| lse `[N]`             | length-N `Vector{Float32}`                        |
| lse pairs `[N, 2]`    | `2×N` `Matrix{Float32}`, column n = (m, l), lse = m + l (`lse = :pair`; see below) |
| CE records `[N, K]`   | `K×N` Float32 matrix (one shard's, `cross_entropy_partial`), K = 9 (`cross_entropy_record_fields()`), or 6 / 7 |
| CE records `[W, N, K]`| `K×N×W` Float32 array, shards in rank order (`cross_entropy_combine`) |
| KD records `[N, 7]`   | `7×N` Float32 matrix (one shard's, `kd_partial`) |
| KD records `[W, N, 7]`| `7×N×W` Float32 array, shards in rank order (`kd_combine`) |
| KD row statistics `[N, 5]` | `5×N` Float32 matrix (`kd_combine` → `kd_bwd`; JSD and a top-K teacher: `kd_combine` → `kd_terms_partial`, `kd_terms_combine` → `kd_bwd`) |
| KD terms' records `[N, 5]` | `5×N` Float32 matrix (one shard's, `kd_terms_partial`) |
| KD terms' records `[W, N, 5]` | `5×N×W` Float32 array, shards in rank order (`kd_terms_combine`) |
| LSE records `[N, 6]`  | `6×N` Float32 matrix (one shard's, `logsumexp_partial`) |
| LSE records `[W, N, 6]`| `6×N×W` Float32 array, shards in rank order (`logsumexp_combine`) |

Record widths are `LibFusedCE.FCE_CE_RECORD_FIELDS_LOSS` / `_ENTROPY` / `_ALL` (6 / 7 / 9),
`FCE_LSE_RECORD_FIELDS` (6), `FCE_KD_RECORD_FIELDS` (7) and `FCE_KD_TERMS_RECORD_FIELDS` (5) since 0.2.0
(0.2.0: 4 / 5 / 7, 2, 5 and 3). Every record carries its shard's column range `[vocab_start, end)` (Int32
bits in two Float32 rows: CE rows 5-6, LSE 3-4, KD 6-7, KD terms 4-5, 1-based); the combines check that the
ranges tile `[0, vocab_total)` in rank order and give NaN columns (argmax -1) otherwise — overlapping shards,
a gap, shards out of order or a missing one are never a plausible number, and not an error either. A shard
of padding alone (`vocab_start = vocab_total`) is accepted: its records are neutral.

An lse (the logsumexp a forward saves for its backward, or a combine's for each shard) comes in two forms,
both Float32: a length-N vector, the lse itself, or a `2×N` matrix of its pairs (the C `[N, 2]`, contiguous),
column n = (m, l) with m the column's max (of the transformed logits z for cross-entropy; of the raw x for
logsumexp) and l the log of the shifted sum, lse = m + l (`scale * m + l` for logsumexp: `lse_from_pairs`).
Every output keyword `lse` (and `logsumexp_combine`'s `out`) takes `:pair` to allocate the pairs, and every
lse argument takes either form. A backward or a shard's softmax from the pairs forms each probability from
max-shifted values as the forward does: its gradient has the fused gradient's bits and holds at any common
offset of the logits; from the vector each probability carries the Float32 lse's rounding (`|lse| 2^-24`
relative). Pass the pairs where an lse is saved for a backward or handed to a shard.

Class indices are 1-based everywhere (targets, `argmax` outputs, top-K ids, `ignore_index`); the
binding subtracts 1 before calling the library, so `ignore_index = 0` works as well as the default -100.
The one exception is `vocab_start` (vocabulary-parallel cross-entropy, linear cross-entropy, distillation,
logsumexp and temperature softmax), an offset rather than a class: the number of vocabulary columns before a
shard, passed to the library as is (the shard holds the 1-based classes `vocab_start+1 : vocab_start+size(logits, 1)`,
or `vocab_start+1 : vocab_start+size(weight, 2)` for a shard of the LM head).
Any strided array works as long as its first dimension has unit stride (a view of a padded matrix
is fine). Element types: `Float32`, `Float16`, any 16-bit type named `BFloat16` (BFloat16s.jl) for
floating data; `Int32`/`Int64` for indices. Options are keyword arguments whose defaults are the loaded
library's, from its `fce_*_init` functions (the header's `*_INIT` values); every options/outputs struct
handed to the library is filled by those functions first. Failures throw `FusedCEError` carrying the
library's message. `FusedCE.build_info()` tells what the library was built with.
"""
module FusedCE

using Libdl

include("LibFusedCE.jl")
using .LibFusedCE
const L = LibFusedCE

export Handle, FusedCEError, default_handle, library_path, version, abi_version, build_info, lse_from_pairs,
       cross_entropy, cross_entropy_fwd, cross_entropy_bwd, cross_entropy_record_fields, cross_entropy_partial,
       cross_entropy_combine, logsumexp, logsumexp_partial, logsumexp_combine, temp_softmax,
       kd_loss, kd_loss_topk, kd_partial, kd_combine, kd_bwd, kd_terms_partial, kd_terms_combine,
       linear_cross_entropy, linear_cross_entropy_fwd, linear_cross_entropy_bwd, linear_cross_entropy_partial

# ------------------------------------------------------------------------------------------------
# Loading
# ------------------------------------------------------------------------------------------------

const _lib = Ref{Ptr{Cvoid}}(C_NULL)
const _libpath = Ref{String}("")

"""
Where the library is looked for: `ENV["FUSEDCE_LIBRARY"]` (a file, or a folder holding libfusedce.so),
then the in-tree build (`<repo>/build/libfusedce.so`), then the system loader (`libfusedce.so.<ABI>`).
"""
function _library_candidates()
    c = String[]
    env = get(ENV, "FUSEDCE_LIBRARY", "")
    if !isempty(env)
        push!(c, abspath(isdir(env) ? joinpath(env, "libfusedce.so") : env))
        return c  # an explicit choice is never silently replaced
    end
    intree = normpath(joinpath(@__DIR__, "..", "..", "..", "..", "build", "libfusedce.so"))
    isfile(intree) && push!(c, intree)
    push!(c, "libfusedce.so.$(L.FCE_ABI_VERSION)")
    push!(c, "libfusedce")
    return c
end

function __init__()
    cands = _library_candidates()
    lib = nothing
    for p in cands
        lib = Libdl.dlopen(p, Libdl.RTLD_LAZY | Libdl.RTLD_LOCAL; throw_error = false)
        lib === nothing || break
    end
    lib === nothing && error("FusedCE: cannot load libfusedce (tried $(join(cands, ", "))); set " *
                             "ENV[\"FUSEDCE_LIBRARY\"] to the library's path")
    L.load_library!(lib)
    abi = L.fce_abi_version()
    if abi != L.FCE_ABI_VERSION
        error("FusedCE: $(Libdl.dlpath(lib)) has ABI $(abi), these bindings were generated for ABI " *
              "$(L.FCE_ABI_VERSION); regenerate them (tools/gen_julia.py)")
    end
    _lib[] = lib
    _libpath[] = Libdl.dlpath(lib)
    empty!(_handles)
    _load_defaults!()
    return nothing
end

"Path of the loaded libfusedce."
library_path() = _libpath[]
"Version of the loaded library (`fce_version_string`)."
version() = VersionNumber(unsafe_string(L.fce_version_string()))
"Version of the header these bindings were generated from."
header_version() = VersionNumber(L.FCE_VERSION_MAJOR, L.FCE_VERSION_MINOR, L.FCE_VERSION_PATCH)
"ABI version of the loaded library."
abi_version() = Int(L.fce_abi_version())

"""
    build_info()

What the loaded library was built with (`fce_build_info`), as a NamedTuple: `version_number`
(MAJOR*10000 + MINOR*100 + PATCH), `abi_version`, `cuda_backend` (a `Bool`: false for a CPU-only build),
`cuda_runtime_version` (CUDART_VERSION compiled against, 13000 = 13.0; 0 without CUDA), `cublas_version`
(CUBLAS_VERSION of the cuBLAS headers; 0 without CUDA), `version_string` ("MAJOR.MINOR.PATCH") and
`cuda_architectures` (GPU code in the library, space separated, e.g. "sm_80 sm_90 compute_90"; "" without
CUDA).
"""
function build_info()
    # FCE_MAX_STRUCT_SIZE zeroed bytes: room for a newer library's larger struct
    buf = zeros(UInt8, L.FCE_MAX_STRUCT_SIZE)
    b = GC.@preserve buf begin
        p = Ptr{L.fce_build_info_t}(pointer(buf))
        unsafe_store!(Ptr{UInt32}(p), UInt32(L.FCE_MAX_STRUCT_SIZE))
        _check(L.fce_build_info(p), :fce_build_info)
        unsafe_load(p)
    end
    text(p) = p == C_NULL ? "" : unsafe_string(p)
    return (version_number = Int(b.version_number), abi_version = Int(b.abi_version),
            cuda_backend = b.cuda_backend != 0, cuda_runtime_version = Int(b.cuda_runtime_version),
            cublas_version = Int(b.cublas_version), version_string = text(b.version_string),
            cuda_architectures = text(b.cuda_architectures))
end

# ------------------------------------------------------------------------------------------------
# Errors
# ------------------------------------------------------------------------------------------------

# status value -> name, from the generated constants (no hand-written list to drift)
const _STATUS_NAMES = Dict{UInt32,String}()
for n in names(L; all = true)
    s = string(n)
    if startswith(s, "FCE_STATUS_")
        _STATUS_NAMES[UInt32(getfield(L, n))] = s[length("FCE_STATUS_")+1:end]
    end
end

"""
    FusedCEError

A failed libfusedce call: `status` (the `fce_status_t` value), `name` (e.g. `"SHAPE_MISMATCH"`),
`func` (the C entry point) and `message` (`fce_last_error_message()`, or the status text).
"""
struct FusedCEError <: Exception
    status::UInt32
    name::String
    func::Symbol
    message::String
end

Base.showerror(io::IO, e::FusedCEError) =
    print(io, "FusedCEError: ", e.func, " returned FCE_STATUS_", e.name, ": ", e.message)

function _check(status, func::Symbol)
    status == L.FCE_STATUS_SUCCESS && return nothing
    detail = unsafe_string(L.fce_last_error_message())
    text = unsafe_string(L.fce_status_string(status))
    name = get(_STATUS_NAMES, UInt32(status), "UNKNOWN($(Int(status)))")
    throw(FusedCEError(UInt32(status), name, func, isempty(detail) ? text : detail))
end

# ------------------------------------------------------------------------------------------------
# Handles
# ------------------------------------------------------------------------------------------------

"""
    Handle(device = :cpu, id = 0)

A library handle for one device (`:cpu` or `:cuda`), freed by a finalizer (or `close`). One handle may
be used by one thread at a time; `default_handle()` gives each thread its own CPU handle.
"""
mutable struct Handle
    ptr::L.fce_handle_t
    device::Symbol
    id::Int
    function Handle(device::Symbol = :cpu, id::Integer = 0)
        dt = device === :cpu ? L.kDLCPU : device === :cuda ? L.kDLCUDA :
             throw(ArgumentError("device must be :cpu or :cuda, got :$device"))
        r = Ref{L.fce_handle_t}(C_NULL)
        _check(L.fce_handle_create(Int32(dt), Int32(id), r), :fce_handle_create)
        h = new(r[], device, Int(id))
        finalizer(_destroy!, h)
        return h
    end
end

function _destroy!(h::Handle)
    if h.ptr != C_NULL
        L.fce_handle_destroy(h.ptr)
        h.ptr = C_NULL
    end
    return nothing
end
Base.close(h::Handle) = _destroy!(h)
Base.show(io::IO, h::Handle) = print(io, "FusedCE.Handle(:", h.device, ", ", h.id, h.ptr == C_NULL ? ", closed)" : ")")

const _handles = Dict{Int,Handle}()
const _handles_lock = ReentrantLock()

"The calling thread's CPU handle, created on first use."
function default_handle()
    tid = Threads.threadid()
    lock(_handles_lock) do
        get!(() -> Handle(:cpu), _handles, tid)
    end
end

function _ptr(h::Handle)
    h.ptr == C_NULL && throw(ArgumentError("the FusedCE.Handle was closed"))
    return h.ptr
end

# ------------------------------------------------------------------------------------------------
# Arrays as DLTensors
# ------------------------------------------------------------------------------------------------

_dltype(::Type{Float32}) = L.DLDataType(L.kDLFloat, 32, 1)
_dltype(::Type{Float16}) = L.DLDataType(L.kDLFloat, 16, 1)
_dltype(::Type{Float64}) = L.DLDataType(L.kDLFloat, 64, 1)  # the library reports it as unsupported
_dltype(::Type{Int32}) = L.DLDataType(L.kDLInt, 32, 1)
_dltype(::Type{Int64}) = L.DLDataType(L.kDLInt, 64, 1)
function _dltype(::Type{T}) where {T}
    if nameof(T) === :BFloat16 && isbitstype(T) && sizeof(T) == 2
        return L.DLDataType(L.kDLBfloat, 16, 1)
    end
    throw(ArgumentError("FusedCE: arrays of $T cannot be passed to libfusedce " *
                        "(Float32, Float16, BFloat16, Int32 or Int64)"))
end

"""
A DLTensor describing a Julia array, with what it points into (the array, the shape and stride
vectors) kept reachable: hold it in `GC.@preserve` while the pointer is in use.
"""
struct Tensor
    ref::Base.RefValue{L.DLTensor}
    shape::Vector{Int64}
    strides::Vector{Int64}
    array::Any
end

function Tensor(x::AbstractArray{T}) where {T}
    x isa StridedArray ||
        throw(ArgumentError("FusedCE: a $(typeof(x)) has no strided memory layout; pass collect(x)"))
    n = ndims(x)
    shape = Int64[size(x, n - i + 1) for i in 1:n]        # C's axes are Julia's reversed
    strides_ = Int64[stride(x, n - i + 1) for i in 1:n]
    dl = L.DLTensor(convert(Ptr{Cvoid}, pointer(x)), L.DLDevice(L.kDLCPU, 0), Cint(n), _dltype(T),
                    pointer(shape), pointer(strides_), UInt64(0))
    return Tensor(Ref(dl), shape, strides_, x)
end

_tensor(::Nothing) = nothing
_tensor(x::AbstractArray) = Tensor(x)
_tensor(x::Real) = Tensor(fill(Float32(x)))                 # a 0-dimensional fp32 scalar

_ptr(t::Tensor) = Base.unsafe_convert(Ptr{L.DLTensor}, t.ref)
_ptr(::Nothing) = Ptr{L.DLTensor}(C_NULL)

# 1-based Julia class indices -> the library's 0-based ones. Shifting everything (ignore_index too)
# by one is a bijection, so no target can become or stop being ignored.
function _indices0(t::AbstractArray{<:Integer})
    T = eltype(t) === Int32 ? Int32 : Int64
    out = similar(t, T)
    @inbounds for i in eachindex(t, out)
        out[i] = T(t[i]) - one(T)
    end
    return out
end

# 1-based top-K ids -> the library's 0-based ones; an unused slot (id ≤ 0) becomes -1 (never wraps around).
function _topk_ids0(ids::AbstractArray{<:Integer})
    T = eltype(ids) === Int32 ? Int32 : Int64
    out = similar(ids, T)
    @inbounds for i in eachindex(ids, out)
        out[i] = ids[i] <= 0 ? -one(T) : T(ids[i]) - one(T)
    end
    return out
end

# An output argument: false/nothing = not requested, true = allocate with `make()`, an array = use it.
_out(x::Bool, make) = x ? make() : nothing
_out(::Nothing, make) = nothing
_out(x::AbstractArray, make) = x

_vecf32(n) = Vector{Float32}(undef, n)

# An lse output: false/nothing = not requested, true = a length-N vector, :pair = its 2×N pairs (the C [N, 2]),
# an array = use it (the library checks its shape: [N] or [N, 2] contiguous).
_lse_out(x::Bool, n) = x ? _vecf32(n) : nothing
_lse_out(::Nothing, n) = nothing
_lse_out(x::AbstractArray, n) = x
function _lse_out(x::Symbol, n)
    x === :pair || throw(ArgumentError("an lse output is false, true, :pair or an array; got :$x"))
    return Matrix{Float32}(undef, 2, n)
end

"""
    lse_from_pairs(lse; scale = 1)

The lse of every column from its pairs: for a `2×N` matrix (what `lse = :pair` returns, column n = (m, l))
the Float32 vector `scale * m + l`, formed in Float64 and rounded once (within a Float32 rounding of the
vector form the library writes); `scale` is 1 for cross-entropy's and linear cross-entropy's pairs (m the
max of the transformed logits) and the partials' `scale` for logsumexp's (m the raw max). A vector (an lse
already) is returned as a `Vector{Float32}`. Another first dimension than 2 is an `ArgumentError`.
"""
function lse_from_pairs(lse::AbstractMatrix; scale::Real = 1)
    size(lse, 1) == 2 || throw(ArgumentError("lse pairs are a 2×N matrix; got $(join(size(lse), '×'))"))
    s = Float64(scale)
    return Float32[Float32(s * Float64(lse[1, n]) + Float64(lse[2, n])) for n in 1:size(lse, 2)]
end
lse_from_pairs(lse::AbstractVector; scale::Real = 1) = Vector{Float32}(lse)
_loss_buffer(reduction::Symbol, n) = reduction === :none ? Vector{Float32}(undef, n) : fill(NaN32)
_scalar_or_vec(x) = x isa AbstractArray && ndims(x) == 0 ? x[] : x

const _REDUCTIONS = Dict(:none => L.FCE_REDUCTION_NONE, :sum => L.FCE_REDUCTION_SUM,
                         :mean => L.FCE_REDUCTION_MEAN)
const _REDUCTION_NAMES = Dict(v => k for (k, v) in _REDUCTIONS)
const _DIVERGENCES = Dict(:forward_kl => L.FCE_KD_FORWARD_KL, :reverse_kl => L.FCE_KD_REVERSE_KL,
                          :jsd => L.FCE_KD_JSD)
const _DIVERGENCE_NAMES = Dict(v => k for (k, v) in _DIVERGENCES)
const _TOPK_NORMS = Dict(:full_vocab => L.FCE_KD_TOPK_FULL_VOCAB, :renormalize => L.FCE_KD_TOPK_RENORMALIZE)
const _TOPK_NORM_NAMES = Dict(v => k for (k, v) in _TOPK_NORMS)

function _enum(table, name::Symbol, what)
    haskey(table, name) || throw(ArgumentError("$what must be one of $(sort(collect(keys(table)))), got :$name"))
    return Int32(table[name])
end

# ------------------------------------------------------------------------------------------------
# Structs filled by the library's fce_*_init functions
# ------------------------------------------------------------------------------------------------

# Each struct with an init function.
const _INIT_FUNCTIONS = (
    L.fce_ce_options_t => L.fce_ce_options_init, L.fce_ce_outputs_t => L.fce_ce_outputs_init,
    L.fce_ce_bwd_inputs_t => L.fce_ce_bwd_inputs_init,
    L.fce_lse_options_t => L.fce_lse_options_init, L.fce_softmax_options_t => L.fce_softmax_options_init,
    L.fce_kd_options_t => L.fce_kd_options_init, L.fce_kd_teacher_t => L.fce_kd_teacher_init,
    L.fce_kd_outputs_t => L.fce_kd_outputs_init, L.fce_linear_ce_outputs_t => L.fce_linear_ce_outputs_init)
for (T, f) in _INIT_FUNCTIONS
    @eval _init_function(::Type{$T}) = $f
end

"""
    _init!(p::Ptr{T})

Fills the `sizeof(T)` bytes at `p` by the loaded library's init function, `struct_size = sizeof(T)` (this
header's struct): the fields the library knows get its defaults. A newer library gives the fields this
header lacks their defaults itself; an older one zeroes the fields it does not know, and refuses
(`FCE_STATUS_INVALID_ARGUMENT`) a non-zero value set there instead of ignoring it.
"""
function _init!(p::Ptr{T}) where {T}
    f = _init_function(T)
    _check(f(p, sizeof(T)), nameof(f))
    return p
end

# The library's defaults, filled by __init__.
const _DEFAULTS = Dict{DataType,Any}()

function _load_defaults!()
    for (T, _) in _INIT_FUNCTIONS
        r = Ref{T}()
        GC.@preserve r _DEFAULTS[T] = unsafe_load(_init!(Base.unsafe_convert(Ptr{T}, r)))
    end
    _CE[] = _DEFAULTS[L.fce_ce_options_t]
    _LSE[] = _DEFAULTS[L.fce_lse_options_t]
    _SM[] = _DEFAULTS[L.fce_softmax_options_t]
    _KD[] = _DEFAULTS[L.fce_kd_options_t]
    return nothing
end

"""
    FusedCE.defaults(T)

The loaded library's defaults of struct type `T` (e.g. `FusedCE.LibFusedCE.fce_ce_options_t`), from its
`fce_*_init` function; `struct_size` is this header's `sizeof(T)`. The keyword defaults of every function.
"""
defaults(::Type{T}) where {T} = _DEFAULTS[T]::T

"""
A C struct for a call: the library's defaults (its `fce_*_init`) with some fields set, in memory owned
by `buf`. Passed to the `LibFusedCE` wrappers as a `Ptr{T}`, `buf` rooted for the call.
"""
struct CStruct{T}
    buf::Vector{UInt8}
end
Base.cconvert(::Type{Ptr{T}}, s::CStruct{T}) where {T} = s
Base.unsafe_convert(::Type{Ptr{T}}, s::CStruct{T}) where {T} = Ptr{T}(pointer(s.buf))
Base.getindex(s::CStruct{T}) where {T} = GC.@preserve s unsafe_load(Ptr{T}(pointer(s.buf)))

"""
    _cstruct(T; fields...)

A `CStruct{T}` filled by the library's init function (see `_init!`), then with `fields` set. A name
that is not a field of `T` throws (it would otherwise leave the field at its default unnoticed).
"""
function _cstruct(::Type{T}; fields...) where {T}
    kw = (; fields...)
    for k in keys(kw)
        hasfield(T, k) || throw(ArgumentError("FusedCE: $(T) has no field $(k)"))
    end
    buf = Vector{UInt8}(undef, sizeof(T))
    GC.@preserve buf begin
        p = _init!(Ptr{T}(pointer(buf)))
        v = unsafe_load(p)
        v = T(ntuple(i -> get(kw, fieldname(T, i), getfield(v, i)), fieldcount(T))...)
        unsafe_store!(p, v)
    end
    return CStruct{T}(buf)
end

# Defaults of the keyword arguments: the library's (set by __init__).
const _CE = Ref{L.fce_ce_options_t}()
const _LSE = Ref{L.fce_lse_options_t}()
const _SM = Ref{L.fce_softmax_options_t}()
const _KD = Ref{L.fce_kd_options_t}()
_def_reduction() = _REDUCTION_NAMES[UInt32(_CE[].reduction)]
_def_kd_reduction() = _REDUCTION_NAMES[UInt32(_KD[].reduction)]
_def_divergence() = _DIVERGENCE_NAMES[UInt32(_KD[].divergence)]
_def_topk_norm() = _TOPK_NORM_NAMES[UInt32(_KD[].topk_norm)]

function _ce_options(reduction, ignore_index, label_smoothing, z_loss_scale, softcap, logit_scale, cw::Union{Nothing,Tensor};
                     vocab_start::Integer = _CE[].vocab_start, vocab_total::Integer = _CE[].vocab_total)
    # the library's ignore_index is 0-based like its targets; vocab_start is an offset, passed as is
    return _cstruct(L.fce_ce_options_t; reduction = _enum(_REDUCTIONS, reduction, "reduction"),
                    ignore_index = Int64(ignore_index) - 1, label_smoothing = Float32(label_smoothing),
                    z_loss_scale = Float32(z_loss_scale), softcap = Float32(softcap),
                    logit_scale = Float32(logit_scale), class_weights = _ptr(cw),
                    vocab_start = Int64(vocab_start), vocab_total = Int64(vocab_total))
end

# ------------------------------------------------------------------------------------------------
# Cross-entropy
# ------------------------------------------------------------------------------------------------

"""
    cross_entropy_fwd(logits, targets; reduction=:mean, ignore_index=-100, label_smoothing=0,
                      z_loss_scale=0, softcap=0, logit_scale=1, class_weights=nothing,
                      vocab_start=0, vocab_total=0,
                      lse=true, z_loss=false, argmax=false, entropy=false, dlogits=false,
                      grad_loss=nothing, grad_entropy=nothing, argmax_type=Int64, handle=default_handle())

Cross-entropy of `logits` (`V×N`) against 1-based `targets` (length N); see the header's
`fce_ce_options_t` for the math. `vocab_start`/`vocab_total` must stay 0 here (the library refuses a
shard, `FusedCEError` INVALID_ARGUMENT): a shard's loss comes from `cross_entropy_partial` and
`cross_entropy_combine`. Each output keyword is `false` (not computed), `true` (allocated) or
an array to write into (`dlogits = logits` computes the gradient in place). Returns a NamedTuple
`(loss, lse, z_loss, argmax, entropy, dlogits)`, `nothing` for outputs not asked for; `loss` and
`z_loss` are `Float32` scalars for `:sum`/`:mean` and vectors for `:none`; `argmax` is 1-based.

`lse` (Float32): `true` a length-N vector, the lse of each column's transformed logits z; `:pair` a `2×N`
matrix of its pairs, column n = (m, l), m = max z and l = log Σ exp(z - m), lse = m + l (`lse_from_pairs`),
the form to save for `cross_entropy_bwd` (its gradient then has the fused `dlogits`' bits, at any offset of
the logits); or an array of either shape (a `2×N` one contiguous down its columns; another shape is
`FusedCEError` SHAPE_MISMATCH, a strided one UNSUPPORTED_LAYOUT, another element type UNSUPPORTED_DTYPE).

Upstream gradients (Float32, read by the library; `nothing` = none): `grad_loss` multiplies d(loss)/d(logits)
(a number for `:sum`/`:mean`; a number or a length-N vector for `:none`). `grad_entropy` (a number, broadcast,
or a length-N vector; only with `dlogits`, else `FusedCEError` INVALID_ARGUMENT) adds the gradient of
`sum(grad_entropy .* entropy)`, so that `dlogits[:, n] = grad_loss[n] * ∂loss/∂logits[:, n] +
grad_entropy[n] * ∂H_n/∂logits[:, n]`, formed in Float32 and rounded once, for every column (ignored ones
included: their entropy is reported too). With `H = -Σ_j p_j log p_j`, `p = softmax(z)`:
`∂H/∂z_j = p_j (μ - z_j)`, `μ = Σ_k p_k z_k = lse - H`, chained through `logit_scale` and `softcap`
(`z = softcap * tanh(logit_scale * x / softcap)`, or `logit_scale * x` without a softcap) as the loss
gradient is. A wrong length is SHAPE_MISMATCH, a non-Float32 array UNSUPPORTED_DTYPE.
"""
function cross_entropy_fwd(logits::AbstractMatrix, targets::AbstractVector{<:Integer};
                           reduction::Symbol = _def_reduction(), ignore_index::Integer = _CE[].ignore_index,
                           label_smoothing::Real = _CE[].label_smoothing, z_loss_scale::Real = _CE[].z_loss_scale,
                           softcap::Real = _CE[].softcap, logit_scale::Real = _CE[].logit_scale,
                           class_weights::Union{Nothing,AbstractVector} = nothing,
                           vocab_start::Integer = _CE[].vocab_start, vocab_total::Integer = _CE[].vocab_total,
                           lse = true, z_loss = false, argmax = false, entropy = false, dlogits = false,
                           grad_loss::Union{Nothing,Real,AbstractArray} = nothing,
                           grad_entropy::Union{Nothing,Real,AbstractArray} = nothing,
                           argmax_type::Type{<:Union{Int32,Int64}} = Int64, handle::Handle = default_handle())
    N = size(logits, 2)
    loss_a = _loss_buffer(reduction, N)
    lse_a = _lse_out(lse, N)
    zl_a = _out(z_loss, () -> _loss_buffer(reduction, N))
    am_a = _out(argmax, () -> Vector{argmax_type}(undef, N))
    ent_a = _out(entropy, () -> _vecf32(N))
    dl_a = _out(dlogits, () -> similar(logits))
    tl, tt, tcw, tloss, tlse, tzl, tam, tent, tdl, tg, tge =
        Tensor(logits), Tensor(_indices0(targets)), _tensor(class_weights), Tensor(loss_a), _tensor(lse_a),
        _tensor(zl_a), _tensor(am_a), _tensor(ent_a), _tensor(dl_a), _tensor(grad_loss), _tensor(grad_entropy)
    GC.@preserve tl tt tcw tloss tlse tzl tam tent tdl tg tge begin
        opts = _ce_options(reduction, ignore_index, label_smoothing, z_loss_scale, softcap, logit_scale, tcw;
                           vocab_start = vocab_start, vocab_total = vocab_total)
        outs = _cstruct(L.fce_ce_outputs_t; loss = _ptr(tloss), lse = _ptr(tlse), z_loss = _ptr(tzl),
                        argmax = _ptr(tam), entropy = _ptr(tent), dlogits = _ptr(tdl), grad_loss = _ptr(tg),
                        grad_entropy = _ptr(tge))
        _check(L.fce_cross_entropy_fwd(_ptr(handle), C_NULL, _ptr(tl), _ptr(tt), opts, outs, C_NULL, 0),
               :fce_cross_entropy_fwd)
    end
    am_a === nothing || (am_a .+= one(eltype(am_a)))
    return (loss = _scalar_or_vec(loss_a), lse = lse_a, z_loss = zl_a === nothing ? nothing : _scalar_or_vec(zl_a),
            argmax = am_a, entropy = ent_a, dlogits = dl_a)
end

"""
    cross_entropy(logits, targets; kwargs...)

The loss alone (a `Float32` for `:mean`/`:sum`, a vector for `:none`); keywords as `cross_entropy_fwd`.
"""
cross_entropy(logits::AbstractMatrix, targets::AbstractVector{<:Integer}; kw...) =
    cross_entropy_fwd(logits, targets; lse = false, kw...).loss

"""
    cross_entropy_bwd(logits, targets, lse; grad_loss=nothing, entropy=nothing, grad_entropy=nothing,
                      dlogits=similar(logits), options...)

Gradient of the cross-entropy with respect to `logits`, from the `lse` saved by `cross_entropy_fwd`
with the same options, times `grad_loss` (a number, or a vector for `reduction = :none`). Returns dlogits
(`V×N`, the logits' element type; `dlogits = logits` works in place).

`lse` is Float32, the length-N vector or the `2×N` pairs (`cross_entropy_fwd(...; lse = :pair)`). From the
pairs every probability is formed as the forward forms it, `exp((z_j - m) - l)`: the result has the fused
gradient's bits and holds at any common offset of the logits. From the vector each probability carries the
Float32 lse's rounding (`|lse| 2^-24` relative: at logits of 2^25 two equal maxima get p = 1 each instead of
1/2). Another shape is `FusedCEError` SHAPE_MISMATCH, a `2×N` view whose columns are not contiguous
UNSUPPORTED_LAYOUT, another element type UNSUPPORTED_DTYPE.

With `grad_entropy` (Float32, a number or a length-N vector) the gradient of `sum(grad_entropy .* H)` is
added as in `cross_entropy_fwd` (`∂H/∂z_j = p_j (μ - z_j)`, `μ = lse - H`, through `logit_scale`/`softcap`):
`entropy` must then be the forward's `entropy` output (length-N Float32, same options), from which the
library takes μ (`fce_cross_entropy_bwd_ex`; the result has the bits of `cross_entropy_fwd(...; dlogits =
true, grad_loss, grad_entropy)` on the CPU). `grad_entropy` without `entropy` is `FusedCEError`
INVALID_ARGUMENT; `entropy` without `grad_entropy` is not read (`fce_cross_entropy_bwd` is called).

Vocabulary shard (`vocab_total > 0`): `logits` is the shard (`V_local×N`, global classes
`vocab_start+1 : vocab_start+V_local`), `targets` are global, and `lse` is the one of
`cross_entropy_combine` (same options; best its pairs, `lse = :pair` there); the result is the shard's
columns of the whole gradient, 0 in padding rows (global class > `vocab_total`).
"""
function cross_entropy_bwd(logits::AbstractMatrix, targets::AbstractVector{<:Integer}, lse::AbstractVecOrMat;
                           reduction::Symbol = _def_reduction(), ignore_index::Integer = _CE[].ignore_index,
                           label_smoothing::Real = _CE[].label_smoothing, z_loss_scale::Real = _CE[].z_loss_scale,
                           softcap::Real = _CE[].softcap, logit_scale::Real = _CE[].logit_scale,
                           class_weights::Union{Nothing,AbstractVector} = nothing,
                           vocab_start::Integer = _CE[].vocab_start, vocab_total::Integer = _CE[].vocab_total,
                           grad_loss::Union{Nothing,Real,AbstractArray} = nothing,
                           entropy::Union{Nothing,AbstractVector} = nothing,
                           grad_entropy::Union{Nothing,Real,AbstractArray} = nothing,
                           dlogits::AbstractMatrix = similar(logits), handle::Handle = default_handle())
    tl, tt, tlse, tg, tcw, tdl = Tensor(logits), Tensor(_indices0(targets)), Tensor(lse), _tensor(grad_loss),
                                 _tensor(class_weights), Tensor(dlogits)
    tent, tge = grad_entropy === nothing ? (nothing, nothing) : (_tensor(entropy), _tensor(grad_entropy))
    GC.@preserve tl tt tlse tg tcw tdl tent tge begin
        opts = _ce_options(reduction, ignore_index, label_smoothing, z_loss_scale, softcap, logit_scale, tcw;
                           vocab_start = vocab_start, vocab_total = vocab_total)
        if tge === nothing
            _check(L.fce_cross_entropy_bwd(_ptr(handle), C_NULL, _ptr(tl), _ptr(tt), _ptr(tlse), _ptr(tg), opts,
                                           _ptr(tdl), C_NULL, 0), :fce_cross_entropy_bwd)
        else
            ins = _cstruct(L.fce_ce_bwd_inputs_t; lse = _ptr(tlse), grad_loss = _ptr(tg), entropy = _ptr(tent),
                           grad_entropy = _ptr(tge))
            _check(L.fce_cross_entropy_bwd_ex(_ptr(handle), C_NULL, _ptr(tl), _ptr(tt), ins, opts, _ptr(tdl),
                                              C_NULL, 0), :fce_cross_entropy_bwd_ex)
        end
    end
    return dlogits
end

# ------------------------------------------------------------------------------------------------
# Vocabulary-parallel cross-entropy
# ------------------------------------------------------------------------------------------------

function _record_fields(opts)
    k = Ref{Int64}(0)
    _check(L.fce_cross_entropy_record_fields(opts, k), :fce_cross_entropy_record_fields)
    return Int(k[])
end

"""
    cross_entropy_record_fields()

K, the number of Float32 fields of one row's cross-entropy record for the default options
(`fce_cross_entropy_record_fields`; 9 in this version, `LibFusedCE.FCE_CE_RECORD_FIELDS_ALL`; 7 in
0.1.0). The header's "Vocabulary-parallel cross-entropy" lists the fields: 1 m, 2 Σ exp(z - m), 3 z at
the target, 4 Σ w_j z_j, 5-6 the shard's column range `[vocab_start, end)` (Int32 bits), 7 the entropy's
sum, 8 the largest raw logit, 9 its 0-based global index (Int32 bits) (1-based rows of the `K×N` matrix).
"""
cross_entropy_record_fields() = _record_fields(Ptr{L.fce_ce_options_t}(C_NULL))

"""
    cross_entropy_partial(logits_shard, targets; vocab_start, vocab_total, reduction=:mean,
                          ignore_index=-100, label_smoothing=0, z_loss_scale=0, softcap=0,
                          logit_scale=1, class_weights=nothing,
                          records=Matrix{Float32}(undef, K, N), handle=default_handle())

Step 1 of vocabulary-parallel cross-entropy (`fce_cross_entropy_partial`; the math and the record
fields are in the header's "Vocabulary-parallel cross-entropy"): the records of one shard of the
vocabulary, a `K×N` Float32 matrix (the C `[N, K]`, `K = cross_entropy_record_fields()`), written into
`records` if given (contiguous) and returned. A given `records` may be narrower, a prefix of the fields:
`K = LibFusedCE.FCE_CE_RECORD_FIELDS_LOSS` (6: loss, lse and z-loss; the partial then skips the entropy's
sums) or `FCE_CE_RECORD_FIELDS_ENTROPY` (7: and the entropy); `cross_entropy_combine` then refuses the
outputs that width does not hold. Use one width on every shard.

- `logits_shard`: `V_local×N` (Float32, Float16 or BFloat16; a view with unit stride down columns is
  fine), the rows `vocab_start+1 : vocab_start+V_local` of the whole `V×N` logits. The last shard may be
  padded: rows past `vocab_total` are ignored (they may hold anything, NaN included).
- `targets`: length N, Int32/Int64, **global** 1-based classes (`ignore_index` as usual).
- `vocab_start` (required): the 0-based offset of the shard, the number of vocabulary rows before it
  (so `0 ≤ vocab_start ≤ vocab_total`; `vocab_start = vocab_total` is a shard of padding alone, as padding
  a small vocabulary to a multiple of the ranks gives: its records are neutral); `vocab_total` (required):
  V of the whole vocabulary.
- `class_weights`: of the whole vocabulary (length `vocab_total`).

Use the same options on every shard and in `cross_entropy_combine`. Errors: `FusedCEError`
INVALID_ARGUMENT (`vocab_total` 0, `vocab_start` outside `[0, vocab_total]`, options out of domain),
SHAPE_MISMATCH (targets' or records' size, class weights' length), UNSUPPORTED_DTYPE,
UNSUPPORTED_LAYOUT, DEVICE_MISMATCH.
"""
function cross_entropy_partial(logits::AbstractMatrix, targets::AbstractVector{<:Integer};
                               vocab_start::Integer, vocab_total::Integer,
                               reduction::Symbol = _def_reduction(), ignore_index::Integer = _CE[].ignore_index,
                               label_smoothing::Real = _CE[].label_smoothing, z_loss_scale::Real = _CE[].z_loss_scale,
                               softcap::Real = _CE[].softcap, logit_scale::Real = _CE[].logit_scale,
                               class_weights::Union{Nothing,AbstractVector} = nothing,
                               records::Union{Nothing,AbstractMatrix} = nothing, handle::Handle = default_handle())
    tl, tt, tcw = Tensor(logits), Tensor(_indices0(targets)), _tensor(class_weights)
    GC.@preserve tl tt tcw begin
        opts = _ce_options(reduction, ignore_index, label_smoothing, z_loss_scale, softcap, logit_scale, tcw;
                           vocab_start = vocab_start, vocab_total = vocab_total)
        rec_a = records === nothing ? Matrix{Float32}(undef, _record_fields(opts), size(logits, 2)) : records
        trec = Tensor(rec_a)
        GC.@preserve trec begin
            _check(L.fce_cross_entropy_partial(_ptr(handle), C_NULL, _ptr(tl), _ptr(tt), opts, _ptr(trec)),
                   :fce_cross_entropy_partial)
        end
    end
    return rec_a
end

"""
    cross_entropy_combine(records, targets; vocab_total, reduction=:mean, ignore_index=-100,
                          label_smoothing=0, z_loss_scale=0, softcap=0, logit_scale=1,
                          class_weights=nothing, lse=true, z_loss=false, argmax=false, entropy=false,
                          argmax_type=Int64, handle=default_handle())

Step 3 of vocabulary-parallel cross-entropy (`fce_cross_entropy_combine`; the header's
"Vocabulary-parallel cross-entropy" has the math): what `cross_entropy_fwd` of the whole, unsharded
logits returns, from the records of every shard.

- `records`: `K×N×W` Float32, contiguous (the C `[W, N, K]`): the W shards' `cross_entropy_partial`
  results in rank (vocabulary) order, e.g. `cat(r1, r2, ...; dims = 3)` or an all-gather's buffer. Their
  column ranges must tile `[0, vocab_total)` in rank order (the first shard at 0, each where the one before
  ends; shards of padding alone may follow): otherwise every column's loss, lse, z_loss and entropy are NaN
  and its argmax -1 (ignored columns included), never a plausible number, and no error is raised.
- `targets`: length N, global 1-based classes.
- `vocab_total` (required) and the other options: those of the partial calls.

Returns `(loss, lse, z_loss, argmax, entropy, dlogits = nothing)` as `cross_entropy_fwd` does (outputs
`false`/`true`/an array; `lse = :pair` gives the `2×N` pairs, m the max of z over every shard; `argmax` a
1-based global class); no gradient here: pass `lse` (best the pairs: `lse = :pair`) to `cross_entropy_bwd`
(or `linear_cross_entropy_bwd`) with each shard and its `vocab_start`/`vocab_total`. Loss, lse and entropy
agree with the unsharded call within the fp32 rounding of the records' sums; argmax and ignored/NaN rows
exactly. Errors: `FusedCEError` INVALID_ARGUMENT (`vocab_total` 0, options out of domain),
SHAPE_MISMATCH (records not `K×N×W`, targets' length), UNSUPPORTED_LAYOUT (records not contiguous),
UNSUPPORTED_DTYPE, DEVICE_MISMATCH.
"""
function cross_entropy_combine(records::AbstractArray{<:Any,3}, targets::AbstractVector{<:Integer};
                               vocab_total::Integer,
                               reduction::Symbol = _def_reduction(), ignore_index::Integer = _CE[].ignore_index,
                               label_smoothing::Real = _CE[].label_smoothing, z_loss_scale::Real = _CE[].z_loss_scale,
                               softcap::Real = _CE[].softcap, logit_scale::Real = _CE[].logit_scale,
                               class_weights::Union{Nothing,AbstractVector} = nothing,
                               lse = true, z_loss = false, argmax = false, entropy = false,
                               argmax_type::Type{<:Union{Int32,Int64}} = Int64, handle::Handle = default_handle())
    N = size(records, 2)
    loss_a = _loss_buffer(reduction, N)
    lse_a = _lse_out(lse, N)
    zl_a = _out(z_loss, () -> _loss_buffer(reduction, N))
    am_a = _out(argmax, () -> Vector{argmax_type}(undef, N))
    ent_a = _out(entropy, () -> _vecf32(N))
    trec, tt, tcw, tloss, tlse, tzl, tam, tent =
        Tensor(records), Tensor(_indices0(targets)), _tensor(class_weights), Tensor(loss_a), _tensor(lse_a),
        _tensor(zl_a), _tensor(am_a), _tensor(ent_a)
    GC.@preserve trec tt tcw tloss tlse tzl tam tent begin
        opts = _ce_options(reduction, ignore_index, label_smoothing, z_loss_scale, softcap, logit_scale, tcw;
                           vocab_start = 0, vocab_total = vocab_total)
        outs = _cstruct(L.fce_ce_outputs_t; loss = _ptr(tloss), lse = _ptr(tlse), z_loss = _ptr(tzl),
                        argmax = _ptr(tam), entropy = _ptr(tent))
        _check(L.fce_cross_entropy_combine(_ptr(handle), C_NULL, _ptr(trec), _ptr(tt), opts, outs, C_NULL, 0),
               :fce_cross_entropy_combine)
    end
    am_a === nothing || (am_a .+= one(eltype(am_a)))
    return (loss = _scalar_or_vec(loss_a), lse = lse_a, z_loss = zl_a === nothing ? nothing : _scalar_or_vec(zl_a),
            argmax = am_a, entropy = ent_a, dlogits = nothing)
end

# ------------------------------------------------------------------------------------------------
# Logsumexp and temperature softmax
# ------------------------------------------------------------------------------------------------

# vocab_start is an offset, passed as is; 0/0 (the library's defaults) = not a shard.
function _lse_options(scale; vocab_start::Integer = _LSE[].vocab_start, vocab_total::Integer = _LSE[].vocab_total)
    return _cstruct(L.fce_lse_options_t; scale = Float32(scale), vocab_start = Int64(vocab_start),
                    vocab_total = Int64(vocab_total))
end

function _softmax_options(temperature, temperatures::Union{Nothing,Tensor}, lse::Union{Nothing,Tensor};
                          vocab_start::Integer = _SM[].vocab_start, vocab_total::Integer = _SM[].vocab_total)
    return _cstruct(L.fce_softmax_options_t; temperature = Float32(temperature), temperatures = _ptr(temperatures),
                    vocab_start = Int64(vocab_start), vocab_total = Int64(vocab_total), lse = _ptr(lse))
end

"""
    logsumexp(x; scale=1, out=Vector{Float32}(undef, size(x, 2)), handle=default_handle())

`log(sum(exp.(scale .* x[:, n])))` for every column `n` of `x` (`V×N`), in Float32. The logsumexp of a
vocabulary shard's whole rows comes from `logsumexp_partial` and `logsumexp_combine`.
"""
function logsumexp(x::AbstractMatrix; scale::Real = _LSE[].scale, out::AbstractVector = _vecf32(size(x, 2)),
                   handle::Handle = default_handle())
    tx, to = Tensor(x), Tensor(out)
    GC.@preserve tx to begin
        opts = _lse_options(scale)
        _check(L.fce_logsumexp(_ptr(handle), C_NULL, _ptr(tx), opts, _ptr(to), C_NULL, 0), :fce_logsumexp)
    end
    return out
end

"""
    logsumexp_partial(x_shard; vocab_start, vocab_total, scale=1,
                      records=Matrix{Float32}(undef, 6, N), handle=default_handle())

Step 1 of the vocabulary-parallel logsumexp (`fce_logsumexp_partial`; the header's "Vocabulary-parallel
logsumexp"): the records of one shard of the vocabulary, a `6×N` Float32 matrix (the C
`[N, FCE_LSE_RECORD_FIELDS]`, `LibFusedCE.FCE_LSE_RECORD_FIELDS` = 6; 2 in 0.1.0), written into
`records` if given (contiguous) and returned. Per column `n`, over the shard's real rows, in raw units (so
that `scale .* x` never overflows): row 1 `m = maximum(x[:, n])`, the raw max (NaN when one of them is NaN),
row 2 `d = sum(exp.((x[:, n] .- m) .* scale))` (1 when `m` is +Inf, 0 when it is -Inf), rows 3-4 the
shard's column range `[vocab_start, end)` (Int32 bits, `reinterpret(Int32, r[3, n])`), row 5 `scale`, row 6
`vocab_total` (Int32 bits).

- `x_shard`: `V_local×N` (Float32, Float16 or BFloat16; a view with unit stride down columns is fine), the
  rows `vocab_start+1 : vocab_start+V_local` of the whole `V×N` matrix. The last shard may be padded: rows
  past `vocab_total` are ignored (they may hold anything, NaN included).
- `vocab_start` (required): the 0-based offset of the shard, the number of vocabulary rows before it (so
  `0 ≤ vocab_start ≤ vocab_total`; `vocab_total` itself: a shard of padding alone, whose record is neutral);
  `vocab_total` (required): V of the whole vocabulary.
- `scale`: as for `logsumexp` (finite, > 0); `1f0 / Float32(T)` (the Float32 value the softmax forms) gives
  the lse that `temp_softmax` takes for a shard's probabilities at temperature `T`. Use the same `scale` on
  every shard (records of different scales combine to NaN).

Errors: `FusedCEError` INVALID_ARGUMENT (`vocab_total` 0, `vocab_start` outside `[0, vocab_total]`, `scale`
not finite and > 0), SHAPE_MISMATCH (records not `6×N`), UNSUPPORTED_DTYPE (x not Float32/Float16/BFloat16,
records not Float32), UNSUPPORTED_LAYOUT, DEVICE_MISMATCH.
"""
function logsumexp_partial(x::AbstractMatrix; vocab_start::Integer, vocab_total::Integer,
                           scale::Real = _LSE[].scale, records::Union{Nothing,AbstractMatrix} = nothing,
                           handle::Handle = default_handle())
    rec_a = records === nothing ? Matrix{Float32}(undef, L.FCE_LSE_RECORD_FIELDS, size(x, 2)) : records
    tx, trec = Tensor(x), Tensor(rec_a)
    GC.@preserve tx trec begin
        opts = _lse_options(scale; vocab_start = vocab_start, vocab_total = vocab_total)
        _check(L.fce_logsumexp_partial(_ptr(handle), C_NULL, _ptr(tx), opts, _ptr(trec)), :fce_logsumexp_partial)
    end
    return rec_a
end

"""
    logsumexp_combine(records; out=Vector{Float32}(undef, N), handle=default_handle())

Step 3 of the vocabulary-parallel logsumexp (`fce_logsumexp_combine`; the header's "Vocabulary-parallel
logsumexp"): the logsumexp of the whole columns, what `logsumexp` of the unsharded matrix (with the partials'
`scale` s) returns, from the records of every shard: `s M + log D`, `D = sum_r d_r exp((m_r - M) s)`,
`M = max_r m_r` the raw max, in Float64 in rank order, rounded once to Float32 (the same bits on every rank).
NaN when a record is NaN, +Inf when a max is +Inf, -Inf for a column of all -Inf, as `logsumexp` gives them;
otherwise it agrees with `logsumexp` within the Float32 rounding of the records' sums. NaN in every column
too when the records' scales or `vocab_total` differ or their column ranges do not tile `[0, vocab_total)`
in rank order (overlapping shards, a gap, shards out of order; shards of padding alone may follow): never a
plausible number, and no error.

- `records`: `6×N×W` Float32, contiguous (the C `[W, N, FCE_LSE_RECORD_FIELDS]`): the W shards'
  `logsumexp_partial` results in rank (vocabulary) order, e.g. `cat(r1, r2, ...; dims = 3)` or an
  all-gather's buffer.
- `out`: a length-N Float32 vector (the lse), `:pair` (a `2×N` Float32 matrix allocated for the pairs
  `(M, log D)`, lse = `s M + log D`: `lse_from_pairs(out; scale = s)`), or a `2×N` Float32 matrix of yours;
  written and returned. The pairs are the form a shard's `temp_softmax` should take: no overflow and no
  rounding of the size of `x / T` at any temperature.

Errors: `FusedCEError` SHAPE_MISMATCH (records not `6×N×W`, `out` neither length N nor `2×N`),
UNSUPPORTED_LAYOUT (records or a `2×N` `out` not contiguous), UNSUPPORTED_DTYPE (not Float32),
DEVICE_MISMATCH; `ArgumentError` for another symbol.
"""
function logsumexp_combine(records::AbstractArray{<:Any,3};
                           out::Union{Symbol,AbstractVecOrMat} = _vecf32(size(records, 2)),
                           handle::Handle = default_handle())
    out isa Symbol && (out = _lse_out(out, size(records, 2)))
    trec, to = Tensor(records), Tensor(out)
    GC.@preserve trec to begin
        _check(L.fce_logsumexp_combine(_ptr(handle), C_NULL, _ptr(trec), _ptr(to)), :fce_logsumexp_combine)
    end
    return out
end

"""
    temp_softmax(logits; temperature=1, temperatures=nothing, probs=true, logprobs=false,
                 eltype=Float32, vocab_start=0, vocab_total=0, lse=nothing, handle=default_handle())

Softmax of every column of `logits` (`V×N`) at a temperature (`temperatures`: one per column,
overriding `temperature`); 0 is greedy (one-hot at the first maximum). `probs`/`logprobs`: `false`,
`true` (allocated with element type `eltype`: Float32 or the logits' type) or an array (`probs = logits`
works in place). Returns `(probs, logprobs)`.

Vocabulary shard (`vocab_total > 0`, `fce_temp_softmax` with the header's shard options): `logits` is the
shard (`V_local×N`, the rows `vocab_start+1 : vocab_start+V_local` of the whole logits; `vocab_start` the
0-based offset, `0 ≤ vocab_start ≤ vocab_total`, `vocab_total` itself a shard of padding alone) and the
result is its rows of the whole columns' distribution, from `lse`, the whole columns' logsumexp of
`logits / temperature`: `logsumexp_combine` of every shard's `logsumexp_partial` with
`scale = 1f0 / Float32(temperature)`, Float32, as its `2×N` pairs (`out = :pair` there; since 0.2.0) or as a
length-N vector. `log p_j = x_j / temperature - lse`, `p_j` its exp; from the pairs `(M, log D)` formed as
`(x_j - M) / temperature - log D`, as the unsharded call forms it (no NaN for finite logits at any
temperature > 0, no rounding of the size of `x / temperature`); from the vector every value carries the
lse's Float32 rounding (`|lse| 2^-24`) and an lse that overflowed Float32 gives probabilities 0. Padding rows
(global class > `vocab_total`) get exactly 0 and -Inf. Errors there: `FusedCEError` NOT_IMPLEMENTED
(per-column `temperatures`, or `temperature` 0 or Inf: one finite temperature > 0 is required),
INVALID_ARGUMENT (no `lse`; `vocab_start` outside `[0, vocab_total]`), SHAPE_MISMATCH (`lse` neither length N
nor `2×N`), UNSUPPORTED_LAYOUT (a `2×N` `lse` not contiguous), UNSUPPORTED_DTYPE (`lse` not Float32).
Without a shard `lse` is not read.

Errors in general: `FusedCEError` INVALID_ARGUMENT (`temperature` negative or NaN, neither `probs` nor
`logprobs`), SHAPE_MISMATCH, UNSUPPORTED_DTYPE, UNSUPPORTED_LAYOUT, DEVICE_MISMATCH.
"""
function temp_softmax(logits::AbstractMatrix; temperature::Real = _SM[].temperature,
                      temperatures::Union{Nothing,AbstractVector} = nothing, probs = true, logprobs = false,
                      eltype::Type = Float32, vocab_start::Integer = _SM[].vocab_start,
                      vocab_total::Integer = _SM[].vocab_total, lse::Union{Nothing,AbstractVecOrMat} = nothing,
                      handle::Handle = default_handle())
    p_a = _out(probs, () -> similar(logits, eltype))
    lp_a = _out(logprobs, () -> similar(logits, eltype))
    tx, tts, tlse, tp, tlp = Tensor(logits), _tensor(temperatures), _tensor(lse), _tensor(p_a), _tensor(lp_a)
    GC.@preserve tx tts tlse tp tlp begin
        opts = _softmax_options(temperature, tts, tlse; vocab_start = vocab_start, vocab_total = vocab_total)
        _check(L.fce_temp_softmax(_ptr(handle), C_NULL, _ptr(tx), opts, _ptr(tp), _ptr(tlp), C_NULL, 0),
               :fce_temp_softmax)
    end
    return (probs = p_a, logprobs = lp_a)
end

# ------------------------------------------------------------------------------------------------
# Knowledge distillation
# ------------------------------------------------------------------------------------------------

# The library's ignore_index is 0-based like its targets; vocab_start is an offset, passed as is.
function _kd_options(divergence, beta, temperature, scale_by_t2, topk_norm, reduction, ignore_index;
                     vocab_start::Integer = _KD[].vocab_start, vocab_total::Integer = _KD[].vocab_total)
    return _cstruct(L.fce_kd_options_t; divergence = _enum(_DIVERGENCES, divergence, "divergence"),
                    beta = Float32(beta), temperature = Float32(temperature), scale_by_t2 = Int32(scale_by_t2 ? 1 : 0),
                    topk_norm = _enum(_TOPK_NORMS, topk_norm, "topk_norm"),
                    reduction = _enum(_REDUCTIONS, reduction, "reduction"), ignore_index = Int64(ignore_index) - 1,
                    vocab_start = Int64(vocab_start), vocab_total = Int64(vocab_total))
end

# The fce_kd_teacher_t of a call: its logits, or its top-K ids (0-based) and log-probabilities; unused ones nothing.
_kd_teacher(ttl, tid, tlp) = _cstruct(L.fce_kd_teacher_t; logits = _ptr(ttl), topk_ids = _ptr(tid),
                                      topk_logprobs = _ptr(tlp))

function _kd(student, teacher_logits, topk_ids, topk_logprobs, targets, divergence, beta, temperature,
             scale_by_t2, topk_norm, reduction, ignore_index, vocab_start, vocab_total, dstudent, grad_loss, handle)
    N = size(student, 2)
    loss_a = _loss_buffer(reduction, N)
    ds_a = _out(dstudent, () -> similar(student))
    ts, ttl, tid, tlp, ttg, tloss, tds, tg =
        Tensor(student), _tensor(teacher_logits), _tensor(topk_ids === nothing ? nothing : _topk_ids0(topk_ids)),
        _tensor(topk_logprobs), _tensor(targets === nothing ? nothing : _indices0(targets)), Tensor(loss_a),
        _tensor(ds_a), _tensor(grad_loss)
    GC.@preserve ts ttl tid tlp ttg tloss tds tg begin
        teacher = _kd_teacher(ttl, tid, tlp)
        opts = _kd_options(divergence, beta, temperature, scale_by_t2, topk_norm, reduction, ignore_index;
                           vocab_start = vocab_start, vocab_total = vocab_total)
        outs = _cstruct(L.fce_kd_outputs_t; loss = _ptr(tloss), dstudent = _ptr(tds), grad_loss = _ptr(tg))
        _check(L.fce_kd_loss(_ptr(handle), C_NULL, _ptr(ts), teacher, _ptr(ttg), opts, outs, C_NULL, 0),
               :fce_kd_loss)
    end
    return (loss = _scalar_or_vec(loss_a), dstudent = ds_a)
end

"""
    kd_loss(student, teacher; targets=nothing, divergence=:forward_kl, beta=0.5, temperature=1,
            scale_by_t2=false, reduction=:mean, ignore_index=-100, vocab_start=0, vocab_total=0,
            dstudent=false, grad_loss=nothing, handle=default_handle())

Distillation divergence between the student's and the teacher's softmax at `temperature`, per column of
`student`/`teacher` (`V×N` each): `:forward_kl` KL(teacher‖student), `:reverse_kl`, or `:jsd` (generalized,
weight `beta` in [0, 1]). `temperature` must lie in [1e-4, 100] (`LibFusedCE.FCE_KD_TEMPERATURE_MIN`,
`FCE_KD_TEMPERATURE_MAX`; `FusedCEError` INVALID_ARGUMENT otherwise). Columns whose 1-based target equals
`ignore_index` are masked; `:mean` is batchmean over unmasked columns. `dstudent = true` (or an array) also
returns the gradient. Returns `(loss, dstudent)`. `vocab_start`/`vocab_total` must stay 0 here (the library
refuses a shard, `FusedCEError` INVALID_ARGUMENT): a shard's divergence comes from `kd_partial`,
`kd_combine` and `kd_bwd` (for `:jsd` and a top-K teacher also `kd_terms_partial` and `kd_terms_combine`).
"""
function kd_loss(student::AbstractMatrix, teacher::AbstractMatrix;
                 targets::Union{Nothing,AbstractVector{<:Integer}} = nothing, divergence::Symbol = _def_divergence(),
                 beta::Real = _KD[].beta, temperature::Real = _KD[].temperature,
                 scale_by_t2::Bool = _KD[].scale_by_t2 != 0,
                 reduction::Symbol = _def_kd_reduction(), ignore_index::Integer = _KD[].ignore_index,
                 vocab_start::Integer = _KD[].vocab_start, vocab_total::Integer = _KD[].vocab_total,
                 dstudent = false, grad_loss::Union{Nothing,Real,AbstractArray} = nothing,
                 handle::Handle = default_handle())
    return _kd(student, teacher, nothing, nothing, targets, divergence, beta, temperature, scale_by_t2,
               _def_topk_norm(), reduction, ignore_index, vocab_start, vocab_total, dstudent, grad_loss, handle)
end

"""
    kd_loss_topk(student, topk_ids, topk_logprobs; topk_norm=:full_vocab, other keywords as kd_loss)

Distillation from a top-K teacher: `topk_ids` (`K×N`, 1-based; ids ≤ 0 are unused slots) and
`topk_logprobs` (`K×N` Float32, log-probabilities at temperature 1). The teacher's distribution is
renormalized over its K ids; `topk_norm` says whether the student's log-probs are over the full vocabulary
(`:full_vocab`) or renormalized over the K ids (`:renormalize`). A column without a used slot is masked
(loss 0, not counted by `:mean`, gradient 0); an id > V makes the column's loss and gradient NaN. Over
vocabulary shards the same teacher goes to the top-K methods of `kd_partial`, `kd_terms_partial` and
`kd_bwd` (the whole `topk_ids` and `topk_logprobs` on every shard).
"""
function kd_loss_topk(student::AbstractMatrix, topk_ids::AbstractMatrix{<:Integer}, topk_logprobs::AbstractMatrix;
                      targets::Union{Nothing,AbstractVector{<:Integer}} = nothing,
                      divergence::Symbol = _def_divergence(),
                      beta::Real = _KD[].beta, temperature::Real = _KD[].temperature,
                      scale_by_t2::Bool = _KD[].scale_by_t2 != 0, topk_norm::Symbol = _def_topk_norm(),
                      reduction::Symbol = _def_kd_reduction(), ignore_index::Integer = _KD[].ignore_index,
                      vocab_start::Integer = _KD[].vocab_start, vocab_total::Integer = _KD[].vocab_total,
                      dstudent = false, grad_loss::Union{Nothing,Real,AbstractArray} = nothing,
                      handle::Handle = default_handle())
    return _kd(student, nothing, topk_ids, topk_logprobs, targets, divergence, beta, temperature, scale_by_t2,
               topk_norm, reduction, ignore_index, vocab_start, vocab_total, dstudent, grad_loss, handle)
end

# ------------------------------------------------------------------------------------------------
# Vocabulary-parallel knowledge distillation
# ------------------------------------------------------------------------------------------------

# The teacher of a shard call as tensors (logits, top-K ids, top-K log-probabilities; those not given
# `nothing`): the shard's logits, or a top-K teacher with its 1-based ids made 0-based.
_shard_teacher(teacher::AbstractMatrix) = (Tensor(teacher), nothing, nothing)
_shard_teacher(topk_ids::AbstractMatrix{<:Integer}, topk_logprobs::AbstractMatrix) =
    (nothing, Tensor(_topk_ids0(topk_ids)), Tensor(topk_logprobs))

"""
    kd_partial(student_shard, teacher_shard; vocab_start, vocab_total, divergence=:forward_kl, beta=0.5,
               temperature=1, scale_by_t2=false, topk_norm=:full_vocab, reduction=:mean, ignore_index=-100,
               records=Matrix{Float32}(undef, 7, N), handle=default_handle())
    kd_partial(student_shard, topk_ids, topk_logprobs; <the same keywords>)

Step 1 of vocabulary-parallel knowledge distillation (`fce_kd_partial`; the math and the record fields are
in the header's "Vocabulary-parallel knowledge distillation"): the records of one shard of the vocabulary,
a `K×N` Float32 matrix (the C `[N, K]`, `K = LibFusedCE.FCE_KD_RECORD_FIELDS` = 7; 5 in 0.1.0), written
into `records` if given (contiguous) and returned. With `z = logits / temperature`, P the distribution that
weights the divergence (the teacher for `:forward_kl`, the student for `:reverse_kl`) and Q the other, a
record holds, over the shard's real columns: `m_P = max z_P`, `Σ exp(z_P - m_P)`, `m_Q`, `Σ exp(z_Q - m_Q)`,
`X = Σ exp(z_P - m_P) ((z_P - m_P) - (z_Q - m_Q))` and in rows 6-7 the shard's column range
`[vocab_start, end)` (Int32 bits).

- `student_shard`: `V_local×N` (Float32, Float16 or BFloat16; a view with unit stride down columns is
  fine), the rows `vocab_start+1 : vocab_start+V_local` of the whole `V×N` logits. The last shard may be
  padded: rows past `vocab_total` are ignored (they may hold anything, NaN included).
- The teacher, one of:
  - `teacher_shard`: the same rows of the teacher's logits (`V_local×N`, any of those element types; it may
    differ from the student's);
  - a top-K teacher, as `kd_loss_topk` takes it: `topk_ids` (`K×N`, Int32/Int64, **1-based** ids into the
    whole vocabulary, distinct within a column, an id ≤ 0 marks an unused slot) and `topk_logprobs` (`K×N`
    Float32), the whole arrays, the same on every shard (the C `[N, K]`). The teacher's distribution is
    `softmax(topk_logprobs / temperature)` over the used slots; `topk_norm` says whether the student's
    log-probabilities are over the whole vocabulary (`:full_vocab`) or renormalized over the teacher's ids
    (`:renormalize`), as for `kd_loss_topk`. The record then holds the student's max and sum over the shard's
    real columns and over its columns at the teacher's ids in the shard (Q's fields and P's for `:forward_kl`
    and `:jsd`, the other way round for `:reverse_kl`), `X` NaN. A top-K teacher always takes the second
    exchange, whatever the divergence: `kd_combine` with `loss = false`, `kd_terms_partial`,
    `kd_terms_combine`, then `kd_bwd`, each given the same `topk_ids` and `topk_logprobs`. A column without a
    used slot is masked (loss 0, not counted by `:mean`, gradient 0); an id > `vocab_total` makes the column's
    loss and gradient NaN.
- `vocab_start` (required): the 0-based offset of the shard, the number of vocabulary rows before it (so
  `0 ≤ vocab_start ≤ vocab_total`; `vocab_total` itself: a shard of padding alone, whose record is neutral);
  `vocab_total` (required): V of the whole vocabulary.
- `divergence`: `:forward_kl`, `:reverse_kl` or `:jsd` (`:jsd` with `0 < beta < 1` writes the
  forward-KL record, P the teacher, and takes a second exchange after `kd_combine`: `kd_terms_partial`
  and `kd_terms_combine`; at `beta` 0 or 1 it is exactly forward or reverse KL and, with teacher logits,
  takes their steps); `temperature` in [1e-4, 100] as for `kd_loss`. Use the same options on every shard
  and in `kd_combine`, `kd_terms_partial`, `kd_terms_combine` and `kd_bwd` (the partial reads
  `divergence`, `beta`, `temperature` and, with a top-K teacher, `topk_norm`; the others are validated
  only).

The sharded steps give what `kd_loss` (`kd_loss_topk` for a top-K teacher) of the whole rows gives, within
the Float32 rounding of the records' sums. Errors: `FusedCEError` INVALID_ARGUMENT (`vocab_total` 0,
`vocab_start` outside `[0, vocab_total]`, options out of domain), SHAPE_MISMATCH (teacher's or records'
size), UNSUPPORTED_DTYPE (e.g. `topk_logprobs` not Float32), UNSUPPORTED_LAYOUT, DEVICE_MISMATCH;
`ArgumentError` for an unknown `divergence`, `topk_norm` or `reduction`.
"""
kd_partial(student::AbstractMatrix, teacher::AbstractMatrix; kw...) =
    _kd_partial(student, _shard_teacher(teacher); kw...)
kd_partial(student::AbstractMatrix, topk_ids::AbstractMatrix{<:Integer}, topk_logprobs::AbstractMatrix; kw...) =
    _kd_partial(student, _shard_teacher(topk_ids, topk_logprobs); kw...)

function _kd_partial(student::AbstractMatrix, teacher::Tuple; vocab_start::Integer, vocab_total::Integer,
                     divergence::Symbol = _def_divergence(), beta::Real = _KD[].beta,
                     temperature::Real = _KD[].temperature, scale_by_t2::Bool = _KD[].scale_by_t2 != 0,
                     topk_norm::Symbol = _def_topk_norm(),
                     reduction::Symbol = _def_kd_reduction(), ignore_index::Integer = _KD[].ignore_index,
                     records::Union{Nothing,AbstractMatrix} = nothing, handle::Handle = default_handle())
    rec_a = records === nothing ? Matrix{Float32}(undef, L.FCE_KD_RECORD_FIELDS, size(student, 2)) : records
    (ttl, tid, tlp), ts, trec = teacher, Tensor(student), Tensor(rec_a)
    GC.@preserve ts ttl tid tlp trec begin
        opts = _kd_options(divergence, beta, temperature, scale_by_t2, topk_norm, reduction, ignore_index;
                           vocab_start = vocab_start, vocab_total = vocab_total)
        _check(L.fce_kd_partial(_ptr(handle), C_NULL, _ptr(ts), _kd_teacher(ttl, tid, tlp), opts, _ptr(trec)),
               :fce_kd_partial)
    end
    return rec_a
end

"""
    kd_combine(records; vocab_total, targets=nothing, divergence=:forward_kl, beta=0.5, temperature=1,
               scale_by_t2=false, topk_norm=:full_vocab, reduction=:mean, ignore_index=-100, loss=true,
               row_stats=true, handle=default_handle())

Step 3 of vocabulary-parallel knowledge distillation (`fce_kd_combine`; the header's "Vocabulary-parallel
knowledge distillation" has the math): the divergence of the whole rows, what `kd_loss` of the unsharded
logits returns, from the records of every shard. Each record is shifted to the row's maxima M and the
records are merged in rank order in Float64: `KL(P‖Q) = X / D_P - log D_P + log D_Q`.

- `records`: `7×N×W` Float32, contiguous (the C `[W, N, FCE_KD_RECORD_FIELDS]`): the W shards'
  `kd_partial` results in rank (vocabulary) order, e.g. `cat(r1, r2, ...; dims = 3)` or an all-gather's
  buffer. Their column ranges must tile `[0, vocab_total)` in rank order (shards of padding alone may
  follow); otherwise every column's loss (masked ones included) and statistics are NaN, never a plausible
  number, and no error is raised.
- `targets`: optional, length N (Int32/Int64, 1-based): columns whose target equals `ignore_index` are
  masked (loss 0; `:mean` is batchmean over the unmasked columns).
- `vocab_total` (required) and the other options: those of the partial calls (`vocab_start` is not read).
- `row_stats`: `false`, `true` (allocated) or a `5×N` Float32 matrix (the C `[N, FCE_KD_ROW_STATS_FIELDS]`)
  to write into: per column `M_student`, `log D_student`, `M_teacher`, `log D_teacher` (the row's
  log-probabilities are `(z - M) - log D`) and `A` of the gradient `∂L/∂z_j = a_j - q_j A` (`:forward_kl`:
  -1; `:reverse_kl`: KL + 1), for `kd_bwd`. With a top-K teacher fields 3 and 4 are the student's `M` and
  `log D` over the teacher's ids (`:renormalize`'s normalizer).
- `loss`: `true` (computed) or `false` (the C `loss = NULL`: the rows' statistics only, so `row_stats` is
  required). `false` is required for `:jsd` with `0 < beta < 1` and is what a top-K teacher takes: JSD's
  mixture `M = beta*P_teacher + (1-beta)*P_student`, and a top-K teacher's terms at its ids, need the rows'
  normalizers before any term can be formed, so this step gives only the rows' statistics (`A` not yet
  valid) and the loss and `A` come from the second exchange, `kd_terms_partial` then `kd_terms_combine`
  (from a top-K teacher's records `loss = true` gives a NaN loss for KL, and is refused for `:jsd`). For KL
  with teacher logits `loss = false` gives the same complete `row_stats` without the loss.

Returns `(loss, row_stats)`: `loss` a Float32 for `:sum`/`:mean`, a length-N vector for `:none` (nats,
times `temperature^2` with `scale_by_t2`), `nothing` with `loss = false`; `row_stats` `nothing` when not
asked for. The loss agrees with `kd_loss` of the whole rows within the Float32 rounding of the records'
sums; masked columns, all-masked means, NaN and +Inf losses and identical distributions (exactly 0) as
`kd_loss` gives them. Errors: `FusedCEError` INVALID_ARGUMENT (`vocab_total` 0, options out of domain;
`loss = false` with `row_stats = false`; `:jsd` with `0 < beta < 1` and `loss = true` or
`row_stats = false`), SHAPE_MISMATCH (records not `7×N×W`, targets' or row_stats' size), UNSUPPORTED_LAYOUT
(records not contiguous), UNSUPPORTED_DTYPE, DEVICE_MISMATCH; nothing is written on an error.
"""
function kd_combine(records::AbstractArray{<:Any,3}; vocab_total::Integer,
                    targets::Union{Nothing,AbstractVector{<:Integer}} = nothing,
                    divergence::Symbol = _def_divergence(), beta::Real = _KD[].beta,
                    temperature::Real = _KD[].temperature, scale_by_t2::Bool = _KD[].scale_by_t2 != 0,
                    topk_norm::Symbol = _def_topk_norm(),
                    reduction::Symbol = _def_kd_reduction(), ignore_index::Integer = _KD[].ignore_index,
                    loss::Bool = true, row_stats = true, handle::Handle = default_handle())
    N = size(records, 2)
    loss_a = _out(loss, () -> _loss_buffer(reduction, N))
    rs_a = _out(row_stats, () -> Matrix{Float32}(undef, L.FCE_KD_ROW_STATS_FIELDS, N))
    trec, ttg, tloss, trs = Tensor(records), _tensor(targets === nothing ? nothing : _indices0(targets)),
                            _tensor(loss_a), _tensor(rs_a)
    GC.@preserve trec ttg tloss trs begin
        opts = _kd_options(divergence, beta, temperature, scale_by_t2, topk_norm, reduction, ignore_index;
                           vocab_start = 0, vocab_total = vocab_total)
        _check(L.fce_kd_combine(_ptr(handle), C_NULL, _ptr(trec), _ptr(ttg), opts, _ptr(tloss), _ptr(trs), C_NULL, 0),
               :fce_kd_combine)
    end
    return (loss = loss_a === nothing ? nothing : _scalar_or_vec(loss_a), row_stats = rs_a)
end

"""
    kd_terms_partial(student_shard, teacher_shard, row_stats; vocab_start, vocab_total, divergence=:forward_kl,
                     beta=0.5, temperature=1, scale_by_t2=false, topk_norm=:full_vocab, reduction=:mean,
                     ignore_index=-100, records=Matrix{Float32}(undef, 5, N), handle=default_handle())
    kd_terms_partial(student_shard, topk_ids, topk_logprobs, row_stats; <the same keywords>)

Step 3a of vocabulary-parallel knowledge distillation (`fce_kd_terms_partial`, since 0.2.0; the header's
"Vocabulary-parallel knowledge distillation" has the math): the second exchange of JSD and of a top-K
teacher, which works for every divergence (for KL with teacher logits it gives `kd_combine`'s loss a second
way). From the rows' statistics of `kd_combine` (fields 1-4 read: the row's log-probabilities are
`(z - M) - log D`, `z = logits / temperature`), the shard's sums of the element terms of `kd_loss`: a `K×N`
Float32 matrix (the C `[N, K]`, `K = LibFusedCE.FCE_KD_TERMS_RECORD_FIELDS` = 5; 3 in 0.1.0), written into `records` if
given (contiguous) and returned, per column over the shard's real columns (a top-K teacher: over its used
slots whose ids fall in the shard) `Σ_j L_j`, `Σ_j a_j` (unscaled: no `temperature^2`, no mean), Float32
from a Float64 sum on the CPU, `+Inf` where a term is, NaN where a logit or a statistic is or a top-K id is
past `vocab_total`; the number of those slots (a Float32 count; -1 with teacher logits); and in rows 4-5 the
shard's column range `[vocab_start, end)` (Int32 bits). With `p` the
teacher's and `q` the student's probabilities (a top-K teacher: `p` its softmax over the used slots, `q`
the student's over the whole vocabulary or renormalized over the ids, per `topk_norm`) and
`m = beta*p + (1-beta)*q`:
- `:jsd` (`0 < beta < 1`): `L_j = beta p_j log(p_j/m_j) + (1-beta) q_j log(q_j/m_j)`,
  `a_j = (1-beta) q_j log(q_j/m_j)`;
- `:forward_kl`: `L_j = p_j log(p_j/q_j)`, `a_j = -p_j`;
- `:reverse_kl`: `L_j = q_j log(q_j/p_j)`, `a_j = q_j log(q_j/p_j) + q_j`
(a term of zero weight adds 0), so that `∂L/∂z_j = a_j - q_j A` with `A = Σ_j a_j` of the whole row.

- `student_shard`, the teacher (`teacher_shard`, or `topk_ids` and `topk_logprobs`: the whole arrays),
  `vocab_start`, `vocab_total` and the options: those of this shard's `kd_partial` call (`V_local×N`;
  padding rows past `vocab_total` are ignored).
- `row_stats`: `5×N` Float32 from `kd_combine` (for `:jsd` and a top-K teacher its `loss = false` call),
  the same on every rank.

Errors: `FusedCEError` INVALID_ARGUMENT (`vocab_total` 0, `vocab_start` outside `[0, vocab_total]`,
options out of domain), SHAPE_MISMATCH (teacher's, row_stats' or records' size), UNSUPPORTED_DTYPE,
UNSUPPORTED_LAYOUT, DEVICE_MISMATCH; nothing is written on an error.
"""
kd_terms_partial(student::AbstractMatrix, teacher::AbstractMatrix, row_stats::AbstractMatrix; kw...) =
    _kd_terms_partial(student, _shard_teacher(teacher), row_stats; kw...)
kd_terms_partial(student::AbstractMatrix, topk_ids::AbstractMatrix{<:Integer}, topk_logprobs::AbstractMatrix,
                 row_stats::AbstractMatrix; kw...) =
    _kd_terms_partial(student, _shard_teacher(topk_ids, topk_logprobs), row_stats; kw...)

function _kd_terms_partial(student::AbstractMatrix, teacher::Tuple, row_stats::AbstractMatrix;
                           vocab_start::Integer, vocab_total::Integer,
                           divergence::Symbol = _def_divergence(), beta::Real = _KD[].beta,
                           temperature::Real = _KD[].temperature, scale_by_t2::Bool = _KD[].scale_by_t2 != 0,
                           topk_norm::Symbol = _def_topk_norm(),
                           reduction::Symbol = _def_kd_reduction(), ignore_index::Integer = _KD[].ignore_index,
                           records::Union{Nothing,AbstractMatrix} = nothing, handle::Handle = default_handle())
    rec_a = records === nothing ? Matrix{Float32}(undef, L.FCE_KD_TERMS_RECORD_FIELDS, size(student, 2)) : records
    (ttl, tid, tlp), ts, trs, trec = teacher, Tensor(student), Tensor(row_stats), Tensor(rec_a)
    GC.@preserve ts ttl tid tlp trs trec begin
        opts = _kd_options(divergence, beta, temperature, scale_by_t2, topk_norm, reduction, ignore_index;
                           vocab_start = vocab_start, vocab_total = vocab_total)
        _check(L.fce_kd_terms_partial(_ptr(handle), C_NULL, _ptr(ts), _kd_teacher(ttl, tid, tlp), _ptr(trs), opts,
                                      _ptr(trec)), :fce_kd_terms_partial)
    end
    return rec_a
end

"""
    kd_terms_combine(records, row_stats; vocab_total, targets=nothing, divergence=:forward_kl, beta=0.5,
                     temperature=1, scale_by_t2=false, topk_norm=:full_vocab, reduction=:mean, ignore_index=-100,
                     handle=default_handle())

Step 3c of vocabulary-parallel knowledge distillation (`fce_kd_terms_combine`, since 0.2.0): the loss of the
whole rows from every shard's `kd_terms_partial` records, added in rank order in Float64, and the rows' `A`
written into `row_stats` for `kd_bwd`. Per row `loss = Σ L_j` (times `temperature^2` with `scale_by_t2`),
`A = Σ a_j` (for KL with teacher logits the `A` of `kd_combine`: -1, or KL + 1). For `:jsd`
(`M = beta*P + (1-beta)*Q`, P the teacher's and Q the student's softmax of `z = logits / temperature`):
`loss = beta KL(P‖M) + (1-beta) KL(Q‖M)`, and `kd_bwd` then forms
`∂loss/∂z_j = (1-beta) q_j (log(q_j/m_j) - Σ_k q_k log(q_k/m_k))` (divided by `temperature` for the
logits, and scaled by the reduction).

- `records`: `5×N×W` Float32, contiguous (the C `[W, N, FCE_KD_TERMS_RECORD_FIELDS]`): the W shards'
  `kd_terms_partial` results in rank (vocabulary) order, e.g. `cat(r1, r2, ...; dims = 3)`. Their column
  ranges must tile `[0, vocab_total)` in rank order, else every column's loss and `A` are NaN.
- `row_stats`: the `5×N` Float32 matrix of `kd_combine` (the one given to `kd_terms_partial`), updated in
  place: field 5 (`A`) written, fields 1-4 kept. Required: `nothing` is refused by the library
  (INVALID_ARGUMENT).
- `targets`, `vocab_total` and the other options: those of `kd_combine` (columns whose target equals
  `ignore_index` are masked: loss 0; `:mean` is batchmean over the unmasked columns). So are a top-K
  teacher's columns without a used slot (their slot counts, field 3, add up to 0).

Returns `(loss, row_stats)`: `loss` a Float32 for `:sum`/`:mean`, a length-N vector for `:none` (nats),
what `kd_loss` (`kd_loss_topk` for a top-K teacher) of the whole rows returns within the Float32 rounding of
the records' sums (masked columns, all-masked means, NaN and +Inf losses and identical distributions,
exactly 0, as `kd_loss` gives them); `row_stats` the argument. Errors: `FusedCEError` INVALID_ARGUMENT
(`vocab_total` 0, options out of domain, `row_stats` `nothing`), SHAPE_MISMATCH (records not `5×N×W`,
targets' or row_stats' size), UNSUPPORTED_LAYOUT (records not contiguous), UNSUPPORTED_DTYPE,
DEVICE_MISMATCH; nothing is written on an error.
"""
function kd_terms_combine(records::AbstractArray{<:Any,3}, row_stats::Union{Nothing,AbstractMatrix};
                          vocab_total::Integer, targets::Union{Nothing,AbstractVector{<:Integer}} = nothing,
                          divergence::Symbol = _def_divergence(), beta::Real = _KD[].beta,
                          temperature::Real = _KD[].temperature, scale_by_t2::Bool = _KD[].scale_by_t2 != 0,
                          topk_norm::Symbol = _def_topk_norm(),
                          reduction::Symbol = _def_kd_reduction(), ignore_index::Integer = _KD[].ignore_index,
                          handle::Handle = default_handle())
    loss_a = _loss_buffer(reduction, size(records, 2))
    trec, ttg, tloss, trs = Tensor(records), _tensor(targets === nothing ? nothing : _indices0(targets)),
                            Tensor(loss_a), _tensor(row_stats)
    GC.@preserve trec ttg tloss trs begin
        opts = _kd_options(divergence, beta, temperature, scale_by_t2, topk_norm, reduction, ignore_index;
                           vocab_start = 0, vocab_total = vocab_total)
        _check(L.fce_kd_terms_combine(_ptr(handle), C_NULL, _ptr(trec), _ptr(ttg), opts, _ptr(tloss), _ptr(trs),
                                      C_NULL, 0), :fce_kd_terms_combine)
    end
    return (loss = _scalar_or_vec(loss_a), row_stats = row_stats)
end

"""
    kd_bwd(student_shard, teacher_shard, row_stats; vocab_start, vocab_total, targets=nothing,
           divergence=:forward_kl, beta=0.5, temperature=1, scale_by_t2=false, topk_norm=:full_vocab,
           reduction=:mean, ignore_index=-100, grad_loss=nothing, dstudent=similar(student_shard),
           handle=default_handle())
    kd_bwd(student_shard, topk_ids, topk_logprobs, row_stats; <the same keywords>)

Step 4 of vocabulary-parallel knowledge distillation (`fce_kd_bwd`): the shard's columns of
d(loss)/d(student logits) times `grad_loss`, from `kd_combine`'s `row_stats` (`5×N` Float32; for `:jsd`
with `0 < beta < 1` and for a top-K teacher after `kd_terms_combine` has written their `A`), formed in
Float32 and rounded once to the student's element type: per element `(a_j - q_j A) / temperature` (times
`temperature^2` with `scale_by_t2`, divided by the unmasked columns for `:mean`), with the log-probabilities
`(z - M) - log D` of the row statistics and `a_j` the element terms of `kd_loss` (the header's
"Vocabulary-parallel knowledge distillation"). With a top-K teacher, as `kd_loss_topk`: `a_k - q_k A` at
the teacher's ids in the shard, and elsewhere `-q_j A` with `topk_norm = :full_vocab`, 0 with
`:renormalize`. 0 at masked columns (a top-K teacher's columns without a used slot too) and in padding
rows (global class > `vocab_total`).

- `student_shard`, the teacher (`teacher_shard`, or `topk_ids` and `topk_logprobs`: the whole arrays),
  `vocab_start`, `vocab_total` and the options: those of this shard's `kd_partial` call; `targets` and
  `reduction` those of `kd_combine` (the mean counts the same columns).
- `grad_loss`: Float32 upstream gradient, a number (or, for `:none`, a length-N vector); `nothing` = 1.
- `dstudent`: `V_local×N` in the student's element type, written and returned; `dstudent = student_shard`
  works in place.

Agrees with `kd_loss(...; dstudent = true)` (`kd_loss_topk` for a top-K teacher) of the whole rows within
the Float32 rounding of the records' sums. Errors: `FusedCEError` INVALID_ARGUMENT (`vocab_total` 0,
`vocab_start` outside `[0, vocab_total]`, options out of domain), SHAPE_MISMATCH (teacher's, targets',
row_stats', grad_loss' or dstudent's size), UNSUPPORTED_DTYPE (dstudent not the student's type),
UNSUPPORTED_LAYOUT, DEVICE_MISMATCH.
"""
kd_bwd(student::AbstractMatrix, teacher::AbstractMatrix, row_stats::AbstractMatrix; kw...) =
    _kd_bwd(student, _shard_teacher(teacher), row_stats; kw...)
kd_bwd(student::AbstractMatrix, topk_ids::AbstractMatrix{<:Integer}, topk_logprobs::AbstractMatrix,
       row_stats::AbstractMatrix; kw...) =
    _kd_bwd(student, _shard_teacher(topk_ids, topk_logprobs), row_stats; kw...)

function _kd_bwd(student::AbstractMatrix, teacher::Tuple, row_stats::AbstractMatrix;
                 vocab_start::Integer, vocab_total::Integer,
                 targets::Union{Nothing,AbstractVector{<:Integer}} = nothing,
                 divergence::Symbol = _def_divergence(), beta::Real = _KD[].beta,
                 temperature::Real = _KD[].temperature, scale_by_t2::Bool = _KD[].scale_by_t2 != 0,
                 topk_norm::Symbol = _def_topk_norm(),
                 reduction::Symbol = _def_kd_reduction(), ignore_index::Integer = _KD[].ignore_index,
                 grad_loss::Union{Nothing,Real,AbstractArray} = nothing,
                 dstudent::AbstractMatrix = similar(student), handle::Handle = default_handle())
    (ttl, tid, tlp), ts, ttg, trs, tg, tds = teacher, Tensor(student),
                                             _tensor(targets === nothing ? nothing : _indices0(targets)),
                                             Tensor(row_stats), _tensor(grad_loss), Tensor(dstudent)
    GC.@preserve ts ttl tid tlp ttg trs tg tds begin
        opts = _kd_options(divergence, beta, temperature, scale_by_t2, topk_norm, reduction, ignore_index;
                           vocab_start = vocab_start, vocab_total = vocab_total)
        _check(L.fce_kd_bwd(_ptr(handle), C_NULL, _ptr(ts), _kd_teacher(ttl, tid, tlp), _ptr(ttg), _ptr(trs), opts,
                            _ptr(tg), _ptr(tds), C_NULL, 0), :fce_kd_bwd)
    end
    return dstudent
end

# ------------------------------------------------------------------------------------------------
# Linear cross-entropy
# ------------------------------------------------------------------------------------------------

"""
    linear_cross_entropy_fwd(hidden, weight, targets; bias=nothing, <cross-entropy options>,
                             vocab_start=0, vocab_total=0, lse=true, z_loss=false, argmax=false, entropy=false,
                             dhidden=false, dweight=false, dbias=false, grad_loss=nothing,
                             grad_entropy=nothing, accumulate=false, argmax_type=Int64, handle=default_handle())

Cross-entropy of the logits `weight' * hidden (+ bias)` without materializing them: `hidden` is `H×N`,
`weight` `H×V` (the C `[V,H]`), `bias` a length-V vector, `targets` 1-based. Gradients asked for
(`true` or an array) are computed in the same call. Returns
`(loss, lse, z_loss, argmax, entropy, dhidden, dweight, dbias)`. `vocab_start`/`vocab_total` must stay 0
here (the library refuses a shard, `FusedCEError` INVALID_ARGUMENT): a shard of the LM head goes through
`linear_cross_entropy_partial`, `cross_entropy_combine` and `linear_cross_entropy_bwd`. `lse` as for
`cross_entropy_fwd`: `true` a length-N vector, `:pair` the `2×N` pairs (the form to save for
`linear_cross_entropy_bwd`), or an array of either shape.

`grad_entropy` (Float32, a number or a length-N vector; only with a gradient output `dhidden`, `dweight`
or `dbias`, else `FusedCEError` INVALID_ARGUMENT) adds the gradient of `sum(grad_entropy .* entropy)` to
them, through the logits' gradient `grad_loss[n] * ∂loss/∂logits[:, n] + grad_entropy[n] * ∂H_n/∂logits[:, n]`
with `∂H/∂z_j = p_j (μ - z_j)`, `μ = lse - H` (as `cross_entropy_fwd`), every column included.

`accumulate = true` (the library's `FCE_LINEAR_CE_ACCUMULATE`) adds the gradients into the arrays given as
`dhidden` (`H×N`), `dweight` (`H×V`) and `dbias` (length V) instead of overwriting them: gradient
accumulation over micro-batches, e.g. into a Float32 `dweight` kept across them. Each is Float32, Float16 or
BFloat16 (not necessarily hidden's element type); each sum `current + gradient` is formed in Float32 and
rounded once to the array's element type. The arrays are read as well as written, and returned (the same
objects). A gradient asked for with `true` would be allocated uninitialized, so with `accumulate = true` it
is an `ArgumentError`: pass an array (e.g. `zeros`) or `false`. A wrong size is `FusedCEError`
SHAPE_MISMATCH, another element type UNSUPPORTED_DTYPE, a first dimension without unit stride
UNSUPPORTED_LAYOUT.
"""
function linear_cross_entropy_fwd(hidden::AbstractMatrix, weight::AbstractMatrix, targets::AbstractVector{<:Integer};
                                  bias::Union{Nothing,AbstractVector} = nothing,
                                  reduction::Symbol = _def_reduction(), ignore_index::Integer = _CE[].ignore_index,
                                  label_smoothing::Real = _CE[].label_smoothing,
                                  z_loss_scale::Real = _CE[].z_loss_scale,
                                  softcap::Real = _CE[].softcap, logit_scale::Real = _CE[].logit_scale,
                                  class_weights::Union{Nothing,AbstractVector} = nothing,
                                  vocab_start::Integer = _CE[].vocab_start, vocab_total::Integer = _CE[].vocab_total,
                                  lse = true, z_loss = false, argmax = false, entropy = false,
                                  dhidden = false, dweight = false, dbias = false,
                                  grad_loss::Union{Nothing,Real,AbstractArray} = nothing,
                                  grad_entropy::Union{Nothing,Real,AbstractArray} = nothing, accumulate::Bool = false,
                                  argmax_type::Type{<:Union{Int32,Int64}} = Int64, handle::Handle = default_handle())
    _accumulating(accumulate, dhidden, dweight, dbias)
    N = size(hidden, 2)
    loss_a = _loss_buffer(reduction, N)
    lse_a = _lse_out(lse, N)
    zl_a = _out(z_loss, () -> _loss_buffer(reduction, N))
    am_a = _out(argmax, () -> Vector{argmax_type}(undef, N))
    ent_a = _out(entropy, () -> _vecf32(N))
    dh_a = _out(dhidden, () -> similar(hidden))
    dw_a = _out(dweight, () -> similar(weight))
    db_a = _out(dbias, () -> bias === nothing ? throw(ArgumentError("dbias needs a bias")) : similar(bias))
    th, tw, tb, tt, tcw = Tensor(hidden), Tensor(weight), _tensor(bias), Tensor(_indices0(targets)), _tensor(class_weights)
    tloss, tlse, tzl, tam, tent, tdh, tdw, tdb, tg, tge = Tensor(loss_a), _tensor(lse_a), _tensor(zl_a),
        _tensor(am_a), _tensor(ent_a), _tensor(dh_a), _tensor(dw_a), _tensor(db_a), _tensor(grad_loss),
        _tensor(grad_entropy)
    GC.@preserve th tw tb tt tcw tloss tlse tzl tam tent tdh tdw tdb tg tge begin
        opts = _ce_options(reduction, ignore_index, label_smoothing, z_loss_scale, softcap, logit_scale, tcw;
                           vocab_start = vocab_start, vocab_total = vocab_total)
        outs = _cstruct(L.fce_linear_ce_outputs_t; loss = _ptr(tloss), lse = _ptr(tlse), z_loss = _ptr(tzl),
                        argmax = _ptr(tam), entropy = _ptr(tent), dhidden = _ptr(tdh), dweight = _ptr(tdw),
                        dbias = _ptr(tdb), grad_loss = _ptr(tg), grad_entropy = _ptr(tge),
                        flags = _lce_flags(accumulate))
        _check(L.fce_linear_cross_entropy_fwd(_ptr(handle), C_NULL, _ptr(th), _ptr(tw), _ptr(tb), _ptr(tt), opts,
                                              outs, C_NULL, 0), :fce_linear_cross_entropy_fwd)
    end
    am_a === nothing || (am_a .+= one(eltype(am_a)))
    return (loss = _scalar_or_vec(loss_a), lse = lse_a, z_loss = zl_a === nothing ? nothing : _scalar_or_vec(zl_a),
            argmax = am_a, entropy = ent_a, dhidden = dh_a, dweight = dw_a, dbias = db_a)
end

"The loss alone; keywords as `linear_cross_entropy_fwd`."
linear_cross_entropy(hidden::AbstractMatrix, weight::AbstractMatrix, targets::AbstractVector{<:Integer}; kw...) =
    linear_cross_entropy_fwd(hidden, weight, targets; lse = false, kw...).loss

"""
    linear_cross_entropy_bwd(hidden, weight, targets, lse; bias=nothing, <cross-entropy options>,
                             vocab_start=0, vocab_total=0, dhidden=true, dweight=true,
                             dbias=(bias !== nothing), grad_loss=nothing, grad_entropy=nothing,
                             saved_entropy=nothing, accumulate=false, handle=default_handle())

Gradients of linear cross-entropy from the forward's `lse` (same options; Float32, the length-N vector or
the `2×N` pairs of `lse = :pair`, from which the probabilities hold at any offset of the logits, as for
`cross_entropy_bwd`), recomputing the logits chunk by chunk. Each output is `false` (not computed), `true` (allocated: `dhidden` `H×N` in hidden's element
type, `dweight` `H×V` and `dbias` length V in weight's and bias') or an array to write into. Returns
`(dhidden, dweight, dbias)`, `nothing` for those not asked for.

Vocabulary shard (`vocab_total > 0`, step 4 of vocabulary-parallel linear cross-entropy; see
`linear_cross_entropy_partial`): `weight` (`H×V_local`) and `bias` (length `V_local`) are the shard's, the
LM head's columns `vocab_start+1 : vocab_start+V_local` (the last shard may be padded past `vocab_total`;
padding is never read), `targets` are global, `lse` is the one of `cross_entropy_combine` (best its pairs; and
`saved_entropy` its `entropy`), with the partial calls' options. `dweight` and `dbias` are then the shard's
(complete: they depend on this shard's logits only), 0 in padding columns/entries. `dhidden` is this
shard's part of the whole `dhidden` and must be Float32 (`FusedCEError` UNSUPPORTED_DTYPE otherwise;
`dhidden = true` allocates a Float32 `H×N` whatever hidden's element type): sum the parts of every shard
in Float32, then round once (in shard order for the same bits whatever the communicator: an all-reduce's
order is its algorithm's beyond two ranks).

`grad_entropy` (Float32, a number or a length-N vector) adds the entropy's gradient as in
`linear_cross_entropy_fwd`; it needs `saved_entropy`, the forward's `entropy` output (length-N Float32,
same options; `FusedCEError` INVALID_ARGUMENT without it). `saved_entropy` is only read with `grad_entropy`.

`accumulate = true` adds the gradients into the arrays given instead of overwriting them, as in
`linear_cross_entropy_fwd` (Float32 sums rounded once; the arrays returned). Every gradient output must then
be an array or `false`: one left at its default `true` (`dhidden`, `dweight`, and `dbias` with a bias) is an
`ArgumentError`, so pass e.g. `dhidden = false` for the ones not accumulated. On a shard the
Float32 `dhidden` part is added into, and `dweight`'s padding columns and `dbias`' padding entries (past
`vocab_total`) are left as they are instead of written 0.

Errors: `FusedCEError` INVALID_ARGUMENT (options out of domain, `vocab_start` outside `[0, vocab_total]`, no
gradient output), SHAPE_MISMATCH (weight's, bias', targets', lse's or an output's size), UNSUPPORTED_DTYPE
(weight or bias not hidden's element type, lse not Float32, a shard's dhidden not Float32), UNSUPPORTED_LAYOUT,
DEVICE_MISMATCH; `ArgumentError` for `dbias` without a bias and for `accumulate = true` with a gradient
output `true`.
"""
function linear_cross_entropy_bwd(hidden::AbstractMatrix, weight::AbstractMatrix, targets::AbstractVector{<:Integer},
                                  lse::AbstractVecOrMat; bias::Union{Nothing,AbstractVector} = nothing,
                                  reduction::Symbol = _def_reduction(), ignore_index::Integer = _CE[].ignore_index,
                                  label_smoothing::Real = _CE[].label_smoothing,
                                  z_loss_scale::Real = _CE[].z_loss_scale,
                                  softcap::Real = _CE[].softcap, logit_scale::Real = _CE[].logit_scale,
                                  class_weights::Union{Nothing,AbstractVector} = nothing,
                                  vocab_start::Integer = _CE[].vocab_start, vocab_total::Integer = _CE[].vocab_total,
                                  dhidden = true, dweight = true, dbias = bias !== nothing,
                                  grad_loss::Union{Nothing,Real,AbstractArray} = nothing,
                                  grad_entropy::Union{Nothing,Real,AbstractArray} = nothing,
                                  saved_entropy::Union{Nothing,AbstractVector} = nothing, accumulate::Bool = false,
                                  handle::Handle = default_handle())
    _accumulating(accumulate, dhidden, dweight, dbias)
    # a shard's dhidden is its Float32 part of a sum over the shards
    dh_a = _out(dhidden, () -> vocab_total > 0 ? similar(hidden, Float32) : similar(hidden))
    dw_a = _out(dweight, () -> similar(weight))
    db_a = _out(dbias, () -> bias === nothing ? throw(ArgumentError("dbias needs a bias")) : similar(bias))
    th, tw, tb, tt, tlse, tcw = Tensor(hidden), Tensor(weight), _tensor(bias), Tensor(_indices0(targets)),
                                Tensor(lse), _tensor(class_weights)
    tdh, tdw, tdb, tg = _tensor(dh_a), _tensor(dw_a), _tensor(db_a), _tensor(grad_loss)
    # saved_entropy is an input of the backward only with grad_entropy (the library refuses it otherwise)
    tge, tse = grad_entropy === nothing ? (nothing, nothing) : (_tensor(grad_entropy), _tensor(saved_entropy))
    GC.@preserve th tw tb tt tlse tcw tdh tdw tdb tg tge tse begin
        opts = _ce_options(reduction, ignore_index, label_smoothing, z_loss_scale, softcap, logit_scale, tcw;
                           vocab_start = vocab_start, vocab_total = vocab_total)
        outs = _cstruct(L.fce_linear_ce_outputs_t; dhidden = _ptr(tdh), dweight = _ptr(tdw), dbias = _ptr(tdb),
                        grad_loss = _ptr(tg), grad_entropy = _ptr(tge), saved_entropy = _ptr(tse),
                        flags = _lce_flags(accumulate))
        _check(L.fce_linear_cross_entropy_bwd(_ptr(handle), C_NULL, _ptr(th), _ptr(tw), _ptr(tb), _ptr(tt),
                                              _ptr(tlse), opts, outs, C_NULL, 0), :fce_linear_cross_entropy_bwd)
    end
    return (dhidden = dh_a, dweight = dw_a, dbias = db_a)
end

# fce_linear_ce_outputs_t.flags of the `accumulate` keyword
_lce_flags(accumulate::Bool) = accumulate ? UInt64(L.FCE_LINEAR_CE_ACCUMULATE) : UInt64(0)

# `accumulate = true` adds into arrays the caller gives: a gradient asked for with `true` would be allocated
# here, uninitialized, and adding into it is never meant. (Sizes and element types are the library's to check.)
function _accumulating(accumulate::Bool, grads...)
    if accumulate && any(g -> g === true, grads)
        throw(ArgumentError("accumulate = true adds into the arrays given as dhidden/dweight/dbias; pass arrays " *
                            "(e.g. zeros) or false, not true"))
    end
    return nothing
end

# ------------------------------------------------------------------------------------------------
# Vocabulary-parallel linear cross-entropy
# ------------------------------------------------------------------------------------------------

"""
    linear_cross_entropy_partial(hidden, weight_shard, targets; vocab_start, vocab_total, bias=nothing,
                                 reduction=:mean, ignore_index=-100, label_smoothing=0, z_loss_scale=0,
                                 softcap=0, logit_scale=1, class_weights=nothing,
                                 records=Matrix{Float32}(undef, K, N), handle=default_handle())

Step 1 of vocabulary-parallel linear cross-entropy (`fce_linear_cross_entropy_partial`; the header's
"Vocabulary-parallel linear cross-entropy"): the cross-entropy records of one shard of the LM head's
logits `weight_shard' * hidden (+ bias)`, computed in token chunks as `linear_cross_entropy_fwd` without
materializing them, a `K×N` Float32 matrix (the C `[N, K]`, `K = cross_entropy_record_fields()`), written
into `records` if given (contiguous) and returned. They are `cross_entropy_partial`'s records of those
logits (rounded to the inputs' element type as in the unsharded call), so the steps are:

1. each shard: `linear_cross_entropy_partial` → `K×N` records;
2. stack every shard's records in rank (vocabulary) order, `K×N×W` (`cat(r1, r2, ...; dims = 3)` or an
   all-gather's buffer);
3. `cross_entropy_combine(records, targets; vocab_total, lse = :pair, options...)` → loss, lse (its pairs),
   z_loss, argmax, entropy of the whole rows (what `linear_cross_entropy_fwd` of the whole LM head gives);
4. each shard: `linear_cross_entropy_bwd(hidden, weight_shard, targets, combined.lse; vocab_start,
   vocab_total, dhidden = true, ...)` → the shard's `dweight`/`dbias` and its Float32 part of `dhidden`;
   sum the parts of every shard in Float32, in shard order, and round once.

- `hidden`: `H×N` (Float32, Float16 or BFloat16), the whole batch (the same for every shard).
- `weight_shard`: `H×V_local`, hidden's element type: the columns `vocab_start+1 : vocab_start+V_local` of
  the whole `H×V` weight (the C `[V_local, H]` rows). The last shard may be padded: columns past
  `vocab_total` are never read (they may hold anything, NaN included).
- `bias`: optional, length `V_local`, the shard's entries of the bias, hidden's element type.
- `targets`: length N, Int32/Int64, **global** 1-based classes (`ignore_index` as usual).
- `vocab_start` (required): the 0-based offset of the shard, the number of vocabulary columns before it (so
  `0 ≤ vocab_start ≤ vocab_total`; `vocab_total` itself: a shard of padding alone, neutral records);
  `vocab_total` (required): V of the whole vocabulary.
- `class_weights`: of the whole vocabulary (length `vocab_total`).
- `records`: as for `cross_entropy_partial` (a narrower `K` of `LibFusedCE.FCE_CE_RECORD_FIELDS_LOSS` or
  `FCE_CE_RECORD_FIELDS_ENTROPY` skips the entropy's sums; `cross_entropy_combine` then refuses the outputs
  that width does not hold). Use one width on every shard.

The workspace is the handle's cached one, as for `linear_cross_entropy_fwd` (its size:
`LibFusedCE.fce_linear_cross_entropy_partial_workspace_size`). Use the same options on every shard, in
`cross_entropy_combine` and in the backward. Errors: `FusedCEError` INVALID_ARGUMENT (`vocab_total` 0,
`vocab_start` outside `[0, vocab_total]`, options out of domain), SHAPE_MISMATCH (weight's, bias',
targets', records' size, class weights' length), UNSUPPORTED_DTYPE (weight or bias not hidden's element
type, records not Float32), UNSUPPORTED_LAYOUT, DEVICE_MISMATCH.
"""
function linear_cross_entropy_partial(hidden::AbstractMatrix, weight::AbstractMatrix,
                                      targets::AbstractVector{<:Integer}; vocab_start::Integer, vocab_total::Integer,
                                      bias::Union{Nothing,AbstractVector} = nothing,
                                      reduction::Symbol = _def_reduction(), ignore_index::Integer = _CE[].ignore_index,
                                      label_smoothing::Real = _CE[].label_smoothing,
                                      z_loss_scale::Real = _CE[].z_loss_scale,
                                      softcap::Real = _CE[].softcap, logit_scale::Real = _CE[].logit_scale,
                                      class_weights::Union{Nothing,AbstractVector} = nothing,
                                      records::Union{Nothing,AbstractMatrix} = nothing, handle::Handle = default_handle())
    th, tw, tb, tt, tcw = Tensor(hidden), Tensor(weight), _tensor(bias), Tensor(_indices0(targets)),
                          _tensor(class_weights)
    local rec_a
    GC.@preserve th tw tb tt tcw begin
        opts = _ce_options(reduction, ignore_index, label_smoothing, z_loss_scale, softcap, logit_scale, tcw;
                           vocab_start = vocab_start, vocab_total = vocab_total)
        rec_a = records === nothing ? Matrix{Float32}(undef, _record_fields(opts), size(hidden, 2)) : records
        trec = Tensor(rec_a)
        GC.@preserve trec begin
            _check(L.fce_linear_cross_entropy_partial(_ptr(handle), C_NULL, _ptr(th), _ptr(tw), _ptr(tb), _ptr(tt),
                                                      opts, _ptr(trec), C_NULL, 0), :fce_linear_cross_entropy_partial)
        end
    end
    return rec_a
end

end # module FusedCE
