# Tests of FusedCE.jl on the CPU backend: every op against Float64 references written here, bad input,
# and the version. Run by meson (suite `julia`) as
#   bindings/julia/run-julia.sh --project=bindings/julia/FusedCE.jl bindings/julia/FusedCE.jl/test/runtests.jl
# with FUSEDCE_LIBRARY pointing at the build's libfusedce.so and FUSEDCE_EXPECTED_VERSION at the
# project's version.
using Test
using Random
using FusedCE
const L = FusedCE.LibFusedCE

Random.seed!(20240607)

# ------------------------------------------------------------------------------------------------
# Float64 references (columns are rows: X is V×N)
# ------------------------------------------------------------------------------------------------

lse64(z) = (m = isempty(z) ? -Inf : maximum(z); m == -Inf ? -Inf : m + log(sum(exp.(z .- m))))
logsoftmax64(z) = z .- lse64(z)

function ce_ref(X, t; reduction = :mean, ignore_index = -100, label_smoothing = 0.0, z_loss_scale = 0.0,
                softcap = 0.0, logit_scale = 1.0, class_weights = nothing)
    V, N = size(X)
    w = class_weights === nothing ? ones(V) : Float64.(class_weights)
    e, q, c, s = Float64(label_smoothing), Float64(z_loss_scale), Float64(softcap), Float64(logit_scale)
    loss, zl, lses, ent, am = zeros(N), zeros(N), zeros(N), zeros(N), zeros(Int, N)
    den = 0.0
    for n in 1:N
        x = Float64.(X[:, n])
        z = c > 0 ? c .* tanh.(s .* x ./ c) : s .* x
        l = lse64(z)
        p = exp.(z .- l)
        lses[n] = l
        ent[n] = -sum(pj > 0 ? pj * log(pj) : 0.0 for pj in p)
        am[n] = argmax(x)
        t[n] == ignore_index && continue
        ti = t[n]
        loss[n] = (1 - e) * w[ti] * (l - z[ti]) + e / V * sum(w .* (l .- z)) + q * l^2
        zl[n] = q * l^2
        den += w[ti]
    end
    red(v) = reduction === :none ? v : reduction === :sum ? sum(v) : (den > 0 ? sum(v) / den : 0.0)
    return (loss = red(loss), z_loss = red(zl), lse = lses, entropy = ent, argmax = am)
end

# d(sum(g .* f(X)))/dX by central differences, f returning a number or a vector.
function fd_grad(f, X::Array{Float64}; g = 1.0, h = 1e-6)
    G = zeros(size(X))
    for i in eachindex(X)
        xp = copy(X); xp[i] += h
        xm = copy(X); xm[i] -= h
        G[i] = (sum(g .* f(xp)) - sum(g .* f(xm))) / (2h)
    end
    return G
end

function kd_row_terms(logp, logq, divergence, beta)
    # logp: teacher log-probs, logq: student log-probs over the same support
    xlr(a, la, lb) = a > 0 ? a * (la - lb) : 0.0
    p, q = exp.(logp), exp.(logq)
    if divergence === :forward_kl || (divergence === :jsd && beta == 0)
        return sum(xlr.(p, logp, logq))
    elseif divergence === :reverse_kl || (divergence === :jsd && beta == 1)
        return sum(xlr.(q, logq, logp))
    end
    m = beta .* p .+ (1 - beta) .* q
    logm = log.(m)
    return beta * sum(xlr.(p, logp, logm)) + (1 - beta) * sum(xlr.(q, logq, logm))
end

function kd_ref(S, T; targets = nothing, divergence = :forward_kl, beta = 0.5, temperature = 1.0,
                scale_by_t2 = false, reduction = :mean, ignore_index = -100)
    V, N = size(S)
    loss = zeros(N); used = 0
    for n in 1:N
        targets !== nothing && targets[n] == ignore_index && continue
        used += 1
        lq = logsoftmax64(Float64.(S[:, n]) ./ temperature)
        lp = logsoftmax64(Float64.(T[:, n]) ./ temperature)
        loss[n] = kd_row_terms(lp, lq, divergence, beta) * (scale_by_t2 ? temperature^2 : 1.0)
    end
    return reduction === :none ? loss : reduction === :sum ? sum(loss) : (used > 0 ? sum(loss) / used : 0.0)
end

# Column n of a top-K teacher (1-based ids, ≤ 0 unused): the used slots' ids, the teacher's log-probabilities
# over them and the student's there (over the whole vocabulary, or renormalized over the ids).
function topk_column64(S, ids, lps, n; temperature = 1.0, topk_norm = :full_vocab)
    sel = [k for k in 1:size(ids, 1) if ids[k, n] >= 1]
    zs = Float64.(S[:, n]) ./ temperature
    idn = ids[sel, n]
    lp = logsoftmax64(Float64.(lps[sel, n]) ./ temperature)
    lq = topk_norm === :full_vocab ? (zs .- lse64(zs))[idn] : logsoftmax64(zs[idn])
    return (ids = idn, lp = lp, lq = lq)
end

function kd_topk_ref(S, ids, lps; targets = nothing, ignore_index = -100, divergence = :forward_kl, beta = 0.5,
                     temperature = 1.0, topk_norm = :full_vocab, reduction = :mean, scale_by_t2 = false)
    V, N = size(S)
    loss = zeros(N); used = 0
    for n in 1:N
        targets !== nothing && targets[n] == ignore_index && continue
        c = topk_column64(S, ids, lps, n; temperature = temperature, topk_norm = topk_norm)
        isempty(c.ids) && continue
        used += 1
        loss[n] = kd_row_terms(c.lp, c.lq, divergence, beta) * (scale_by_t2 ? temperature^2 : 1.0)
    end
    return reduction === :none ? loss : reduction === :sum ? sum(loss) : (used > 0 ? sum(loss) / used : 0.0)
end

# grad_loss[n] * d(loss_n)/dX[:, n] + grad_entropy[n] * d(H_n)/dX[:, n] for reduction :none, in closed
# form: z = c tanh(s x / c) (or s x), p = softmax(z), dH/dz_j = p_j (mu - z_j) with mu = sum_k p_k z_k, and
# d(loss)/dz_j = (1-e) w_t (p_j - [j = t]) + e/V (sum(w) p_j - w_j) + 2 q lse p_j for a row not ignored.
function ce_entropy_grad_ref(X, t, gl, ge; ignore_index = -100, label_smoothing = 0.0, z_loss_scale = 0.0,
                             softcap = 0.0, logit_scale = 1.0, class_weights = nothing)
    V, N = size(X)
    w = class_weights === nothing ? ones(V) : Float64.(class_weights)
    e, q, c, s = Float64(label_smoothing), Float64(z_loss_scale), Float64(softcap), Float64(logit_scale)
    G = zeros(V, N)
    for n in 1:N
        x = Float64.(X[:, n])
        u = c > 0 ? tanh.(s .* x ./ c) : nothing
        z = c > 0 ? c .* u : s .* x
        dzdx = c > 0 ? s .* (1 .- u .^ 2) : fill(s, V)
        l = lse64(z)
        p = exp.(z .- l)
        mu = sum(p[j] * z[j] for j in 1:V if p[j] > 0)
        dH = [p[j] > 0 ? p[j] * (mu - z[j]) : 0.0 for j in 1:V]
        dL = zeros(V)
        if t[n] != ignore_index
            ti = t[n]
            dL .= (1 - e) * w[ti] .* p .+ e / V .* (sum(w) .* p .- w) .+ 2q * l .* p
            dL[ti] -= (1 - e) * w[ti]
        end
        G[:, n] = (Float64(gl[n]) .* dL .+ Float64(ge[n]) .* dH) .* dzdx
    end
    return G
end

# max |a - ref| <= rtol * max |ref|
close_to_max(a, ref; rtol = 1e-5) = maximum(abs.(Float64.(a) .- ref)) <= rtol * maximum(abs, ref)

approx(a, b; rtol = 2e-5, atol = 2e-5) = all(isapprox.(Float64.(a), Float64.(b); rtol = rtol, atol = atol))

# ------------------------------------------------------------------------------------------------

@testset "FusedCE.jl" begin

@testset "version and loading" begin
    @test FusedCE.version() == FusedCE.header_version()
    @test FusedCE.abi_version() == L.FCE_ABI_VERSION
    @test Int(L.fce_version_number()) == L.FCE_VERSION_NUMBER
    expected = get(ENV, "FUSEDCE_EXPECTED_VERSION", "")
    if !isempty(expected)
        @test FusedCE.version() == VersionNumber(expected)
    end
    want = get(ENV, "FUSEDCE_LIBRARY", "")
    if !isempty(want)
        @test realpath(FusedCE.library_path()) == realpath(want)
    end
    for f in L.FUNCTIONS
        @test getfield(L, Symbol("_fptr_", f))[] != C_NULL
    end
    h = FusedCE.Handle(:cpu)
    dt, di = Ref{Int32}(-1), Ref{Int32}(-1)
    @test L.fce_handle_get_device(h.ptr, dt, di) == L.FCE_STATUS_SUCCESS
    @test dt[] == L.kDLCPU
    close(h)
    @test_throws ArgumentError FusedCE.cross_entropy(randn(Float32, 3, 2), [1, 2]; handle = h)
    @test FusedCE.default_handle() === FusedCE.default_handle()
end

@testset "build information" begin
    b = FusedCE.build_info()
    println("FusedCE.build_info() = ", b)
    @test b isa NamedTuple
    @test keys(b) == (:version_number, :abi_version, :cuda_backend, :cuda_runtime_version, :cublas_version,
                      :version_string, :cuda_architectures)
    @test b.version_number == Int(L.fce_version_number()) == L.FCE_VERSION_NUMBER
    @test b.abi_version == FusedCE.abi_version() == L.FCE_ABI_VERSION
    @test VersionNumber(b.version_string) == FusedCE.version()
    @test b.cuda_backend in (false, true)   # the C field is 0 or 1
    if b.cuda_backend
        @test b.cuda_runtime_version > 0 && b.cublas_version > 0
        @test all(a -> occursin(r"^(sm|compute)_\d+a?$", a), split(b.cuda_architectures))
        @test !isempty(b.cuda_architectures)
    else
        @test (b.cuda_runtime_version, b.cublas_version, b.cuda_architectures) == (0, 0, "")
    end
    # a struct_size below the library's struct is refused
    r = Ref(L.fce_build_info_t(UInt32(8), 0, 0, 0, 0, 0, C_NULL, C_NULL))
    @test L.fce_build_info(r) == L.FCE_STATUS_INVALID_ARGUMENT
end

@testset "defaults come from the library's init functions" begin
    # the library's fce_*_init agree with the header's *_INIT macros
    for (T, init) in ((L.fce_ce_options_t, L.FCE_CE_OPTIONS_INIT), (L.fce_ce_outputs_t, L.FCE_CE_OUTPUTS_INIT),
                      (L.fce_ce_bwd_inputs_t, L.FCE_CE_BWD_INPUTS_INIT),
                      (L.fce_lse_options_t, L.FCE_LSE_OPTIONS_INIT),
                      (L.fce_softmax_options_t, L.FCE_SOFTMAX_OPTIONS_INIT),
                      (L.fce_kd_options_t, L.FCE_KD_OPTIONS_INIT), (L.fce_kd_teacher_t, L.FCE_KD_TEACHER_INIT),
                      (L.fce_kd_outputs_t, L.FCE_KD_OUTPUTS_INIT),
                      (L.fce_linear_ce_outputs_t, L.FCE_LINEAR_CE_OUTPUTS_INIT))
        @test FusedCE.defaults(T) == init
        r = Ref{T}()
        @test FusedCE._init_function(T)(r, sizeof(T)) == L.FCE_STATUS_SUCCESS
        @test r[] == init
    end
    @test L.fce_kd_options_init(Ptr{L.fce_kd_options_t}(C_NULL), sizeof(L.fce_kd_options_t)) ==
          L.FCE_STATUS_INVALID_ARGUMENT
    # struct_size is the size given: defaults, then zeros past this library's struct; a size below the
    # struct's first published size (0.1's, which ended before vocab_start) or above FCE_MAX_STRUCT_SIZE is
    # refused and nothing is written; the first published size itself (an older header's) gets the defaults
    # of the fields it has, and nothing past them is written
    n = sizeof(L.fce_kd_options_t)
    first = Int(fieldoffset(L.fce_kd_options_t, findfirst(==(:vocab_start), fieldnames(L.fce_kd_options_t))))
    @test first == 40 && n == first + 16
    buf = fill(0xab, n + 24)
    GC.@preserve buf begin
        p = Ptr{L.fce_kd_options_t}(pointer(buf))
        @test L.fce_kd_options_init(p, n + 16) == L.FCE_STATUS_SUCCESS
        o = unsafe_load(p)
        @test o.struct_size == n + 16 && o.beta == 0.5f0 && o.ignore_index == -100
        @test o.vocab_start == 0 && o.vocab_total == 0
        @test all(iszero, buf[n+1:n+16]) && all(==(0xab), buf[n+17:end])
        fill!(buf, 0xab)
        @test L.fce_kd_options_init(p, first) == L.FCE_STATUS_SUCCESS
        o = unsafe_load(p)
        @test o.struct_size == first && o.beta == 0.5f0 && o.ignore_index == -100
        @test all(==(0xab), buf[first+1:end])
        fill!(buf, 0xab)
        @test L.fce_kd_options_init(p, first - 8) == L.FCE_STATUS_INVALID_ARGUMENT
        @test L.fce_kd_options_init(p, L.FCE_MAX_STRUCT_SIZE + 1) == L.FCE_STATUS_INVALID_ARGUMENT
        @test all(==(0xab), buf)
    end
    # the keyword defaults are the library's
    d = FusedCE.defaults(L.fce_kd_options_t)
    @test (d.beta, d.temperature, d.ignore_index) == (0.5f0, 1.0f0, -100)
    # a struct for a call: the library's defaults, with the fields given
    s = FusedCE._cstruct(L.fce_kd_options_t; beta = 0.25f0)
    @test s[].beta == 0.25f0 && s[].temperature == 1.0f0 && s[].struct_size == sizeof(L.fce_kd_options_t)
    # a name that is no field (a misspelling) throws instead of leaving the field at its default
    @test_throws ArgumentError FusedCE._cstruct(L.fce_kd_options_t; bta = 0.25f0)
end

V, N = 11, 7
X = randn(Float32, V, N) .* 3
t = rand(1:V, N)
t[3] = -100

@testset "cross_entropy_fwd $(keys(kw))" for kw in (
        (;),
        (reduction = :sum,),
        (reduction = :none,),
        (label_smoothing = 0.1,),
        (z_loss_scale = 1e-2,),
        (softcap = 3.0,),
        (logit_scale = 0.7,),
        (class_weights = rand(Float32, V) .+ 0.5f0,),
        (class_weights = rand(Float32, V) .+ 0.5f0, label_smoothing = 0.2, reduction = :none),
        (softcap = 2.5, logit_scale = 1.3, z_loss_scale = 1e-3, label_smoothing = 0.05, reduction = :sum))
    ref = ce_ref(X, t; kw...)
    r = FusedCE.cross_entropy_fwd(X, t; kw..., lse = true, z_loss = true, argmax = true, entropy = true, dlogits = true)
    @test approx(r.loss, ref.loss)
    @test approx(r.z_loss, ref.z_loss)
    @test approx(r.lse, ref.lse)
    @test approx(r.entropy, ref.entropy)
    @test r.argmax == ref.argmax
    G = fd_grad(Xd -> ce_ref(Xd, t; kw...).loss, Float64.(X))
    @test approx(r.dlogits, G; atol = 1e-5, rtol = 1e-4)
    @test all(r.dlogits[:, 3] .== 0)   # ignored row
    @test FusedCE.cross_entropy(X, t; kw...) == r.loss
    # backward from the saved lse, with an upstream gradient
    g = get(kw, :reduction, :mean) === :none ? rand(Float32, N) : 0.37f0
    d = FusedCE.cross_entropy_bwd(X, t, r.lse; kw..., grad_loss = g)
    Gg = fd_grad(Xd -> ce_ref(Xd, t; kw...).loss, Float64.(X); g = Float64.(g))
    @test approx(d, Gg; atol = 1e-5, rtol = 1e-4)
    r2 = FusedCE.cross_entropy_fwd(X, t; kw..., dlogits = true, grad_loss = g)
    @test approx(r2.dlogits, Gg; atol = 1e-5, rtol = 1e-4)
end

@testset "cross-entropy: conventions" begin
    # Julian ignore_index = 0 (1-based classes; the binding shifts targets and ignore_index together)
    t0 = copy(t); t0[3] = 0
    @test FusedCE.cross_entropy(X, t0; ignore_index = 0) ≈ Float32(ce_ref(X, t0; ignore_index = 0).loss) rtol = 2e-5
    # ignoring a real class (1-based class 1)
    t1 = copy(t); t1[3] = 1
    @test FusedCE.cross_entropy(X, t1; ignore_index = 1, reduction = :sum) ≈
          Float32(ce_ref(X, t1; ignore_index = 1, reduction = :sum).loss) rtol = 2e-5
    # a target out of range that is not ignore_index: NaN loss (not an error status), as the header says
    tbad = copy(t); tbad[1] = V + 1
    @test isnan(FusedCE.cross_entropy(X, tbad))
    # Int32 targets, Int32 argmax
    r = FusedCE.cross_entropy_fwd(X, Int32.(t); argmax = true, argmax_type = Int32)
    @test eltype(r.argmax) == Int32 && r.argmax == ce_ref(X, t).argmax
    # a view into padded storage (row stride > V in C terms)
    big = randn(Float32, V + 5, N)
    big[1:V, :] .= X
    @test FusedCE.cross_entropy(view(big, 1:V, :), t) == FusedCE.cross_entropy(X, t)
    # in-place gradient into the logits' memory
    Xc = copy(X)
    ref = FusedCE.cross_entropy_fwd(X, t; dlogits = true).dlogits
    FusedCE.cross_entropy_fwd(Xc, t; dlogits = Xc)
    @test Xc == ref
    # Float16 logits: gradient in Float16
    r16 = FusedCE.cross_entropy_fwd(Float16.(X), t; dlogits = true)
    @test eltype(r16.dlogits) == Float16
    @test approx(r16.loss, ce_ref(Float16.(X), t).loss)
    # every row ignored: mean is 0 (PyTorch gives NaN), as the header says
    @test FusedCE.cross_entropy(X, fill(-100, N)) == 0
end

function fce_status_name(f)
    try
        f()
    catch e
        e isa FusedCEError || rethrow()
        return e.name
    end
    return "no error"
end

@testset "cross-entropy entropy gradient V=$(Ve) N=$(Ne) $(keys(kw0))" for (Ve, Ne) in ((13, 5), (257, 9), (1031, 4)),
        kw0 in ((;), (softcap = 3.0, logit_scale = 0.7), (label_smoothing = 0.1, z_loss_scale = 1e-2, class_weights = true),
               (logit_scale = 1.3, label_smoothing = 0.05, softcap = 5.0, z_loss_scale = 1e-3))
    kw = haskey(kw0, :class_weights) ? merge(kw0, (class_weights = rand(Float32, Ve) .+ 0.5f0,)) : kw0
    neginf = get(kw, :softcap, 0.0) == 0 && get(kw, :label_smoothing, 0.0) == 0  # (smoothing makes the loss inf)
    Xe = randn(Float32, Ve, Ne) .* 3
    te = rand(1:Ve, Ne)
    te[2] = -100                                  # an ignored row: only the entropy's gradient
    te[3] = 1; Xe[5, 3] += 40                     # a peaked row (p nearly one-hot, not at the target)
    neginf && (Xe[4, 1] = -Inf32; te[1] = 2)      # p_j = 0: that logit's gradient is 0
    gl = rand(Float32, Ne) .* 2 .- 0.5f0
    ge = randn(Float32, Ne)
    ref = ce_entropy_grad_ref(Xe, te, gl, ge; kw...)
    ref0 = ce_entropy_grad_ref(Xe, te, gl, zeros(Ne); kw...)
    # the entropy's term is far above the tolerance (1e-5 of the largest): ignoring grad_entropy, or zeroing
    # the ignored row, fails the comparisons below
    @test maximum(abs.(ref .- ref0)) > 1e-3 * maximum(abs, ref)
    @test maximum(abs, ref[:, 2]) > 1e-4 * maximum(abs, ref)
    if Ve == 13
        # the closed form against central differences of the Float64 loss and entropy (ce_ref's smoothing
        # term is NaN at a -Inf logit, so a very negative finite one stands in for it here)
        Xf = replace(Float64.(Xe), -Inf => -60.0)
        fd = fd_grad(Xd -> Float64.(gl) .* ce_ref(Xd, te; reduction = :none, kw...).loss .+
                           Float64.(ge) .* ce_ref(Xd, te; reduction = :none, kw...).entropy, Xf)
        reff = ce_entropy_grad_ref(Xf, te, gl, ge; kw...)
        @test maximum(abs.(fd .- reff)) <= 1e-6 * maximum(abs, reff)
    end
    # the fused forward, outputs poisoned; it saves the lse's pairs (2×N: the form whose backward has its bits)
    D, E, Ls = fill(NaN32, Ve, Ne), fill(NaN32, Ne), fill(NaN32, 2, Ne)
    r = FusedCE.cross_entropy_fwd(Xe, te; reduction = :none, kw..., lse = Ls, entropy = E, dlogits = D,
                                  grad_loss = gl, grad_entropy = ge)
    @test r.dlogits === D && r.entropy === E && r.lse === Ls
    @test close_to_max(D, ref)
    @test close_to_max(D[:, 2], ref[:, 2]; rtol = 1e-4)    # the ignored row on its own scale
    neginf && @test D[4, 1] == 0
    # the statistics do not depend on grad_entropy; without it the gradient is the loss's alone
    r0 = FusedCE.cross_entropy_fwd(Xe, te; reduction = :none, kw..., entropy = true, dlogits = true, grad_loss = gl)
    @test r0.loss == r.loss && r0.entropy == E
    @test r0.lse isa Vector{Float32} && approx(lse_from_pairs(Ls), r0.lse; rtol = 3e-7, atol = 0)
    @test close_to_max(r0.dlogits, ref0)
    # backward from the saved lse pairs and entropy: the fused forward's bits (CPU)
    D2 = fill(NaN32, Ve, Ne)
    @test FusedCE.cross_entropy_bwd(Xe, te, Ls; reduction = :none, kw..., grad_loss = gl, entropy = E,
                                    grad_entropy = ge, dlogits = D2) === D2
    @test D2 == D
    # from the lse vector: each p_j carries the Float32 lse's rounding, within the bound here
    D2v = FusedCE.cross_entropy_bwd(Xe, te, r0.lse; reduction = :none, kw..., grad_loss = gl, entropy = E,
                                    grad_entropy = ge)
    @test close_to_max(D2v, Float64.(D))
    # without grad_entropy the backward is the loss's (entropy not read)
    D3 = fill(NaN32, Ve, Ne)
    FusedCE.cross_entropy_bwd(Xe, te, Ls; reduction = :none, kw..., grad_loss = gl, entropy = fill(NaN32, Ne),
                              dlogits = D3)
    @test close_to_max(D3, ref0)
    # a scalar grad_entropy is broadcast; grad_loss defaults to 1
    rs = FusedCE.cross_entropy_fwd(Xe, te; reduction = :none, kw..., dlogits = fill(NaN32, Ve, Ne), grad_entropy = 0.75)
    rv = FusedCE.cross_entropy_fwd(Xe, te; reduction = :none, kw..., dlogits = fill(NaN32, Ve, Ne),
                                   grad_entropy = fill(0.75f0, Ne))
    @test rs.dlogits == rv.dlogits
    @test close_to_max(rs.dlogits, ce_entropy_grad_ref(Xe, te, ones(Ne), fill(0.75, Ne); kw...))
    D4 = fill(NaN32, Ve, Ne)
    FusedCE.cross_entropy_bwd(Xe, te, Ls; reduction = :none, kw..., entropy = E, grad_entropy = 0.75, dlogits = D4)
    @test D4 == rs.dlogits
    # a reduced loss: grad_loss a scalar (mean over the weighted non-ignored rows), grad_entropy per row
    rm = FusedCE.cross_entropy_fwd(Xe, te; kw..., reduction = :sum, lse = :pair, entropy = true,
                                   dlogits = fill(NaN32, Ve, Ne), grad_loss = 0.5f0, grad_entropy = ge)
    @test size(rm.lse) == (2, Ne) && eltype(rm.lse) == Float32
    @test close_to_max(rm.dlogits, ce_entropy_grad_ref(Xe, te, fill(0.5, Ne), ge; kw...))
    D5 = fill(NaN32, Ve, Ne)
    FusedCE.cross_entropy_bwd(Xe, te, rm.lse; kw..., reduction = :sum, grad_loss = 0.5f0, entropy = rm.entropy,
                              grad_entropy = ge, dlogits = D5)
    @test D5 == rm.dlogits
    # errors: grad_entropy without the saved entropy, or without dlogits; wrong length or dtype
    @test fce_status_name(() -> FusedCE.cross_entropy_bwd(Xe, te, Ls; reduction = :none, kw..., grad_entropy = ge)) ==
          "INVALID_ARGUMENT"
    err = try
        FusedCE.cross_entropy_bwd(Xe, te, Ls; reduction = :none, kw..., grad_entropy = ge); nothing
    catch e
        e
    end
    @test err isa FusedCEError && err.func === :fce_cross_entropy_bwd_ex && occursin("entropy", err.message)
    @test fce_status_name(() -> FusedCE.cross_entropy_fwd(Xe, te; reduction = :none, kw..., grad_entropy = ge)) ==
          "INVALID_ARGUMENT"
    @test fce_status_name(() -> FusedCE.cross_entropy_fwd(Xe, te; reduction = :none, kw..., dlogits = true,
                                                          grad_entropy = ge[1:end-1])) == "SHAPE_MISMATCH"
    @test fce_status_name(() -> FusedCE.cross_entropy_bwd(Xe, te, Ls; reduction = :none, kw..., entropy = E[1:end-1],
                                                          grad_entropy = ge)) == "SHAPE_MISMATCH"
    @test fce_status_name(() -> FusedCE.cross_entropy_bwd(Xe, te, Ls; reduction = :none, kw..., entropy = E,
                                                          grad_entropy = Float16.(ge))) == "UNSUPPORTED_DTYPE"
end

@testset "fce_cross_entropy_bwd_ex (raw)" begin
    Xr = randn(Float32, 19, 6) .* 2
    tr = rand(1:19, 6); tr[4] = -100
    r = FusedCE.cross_entropy_fwd(Xr, tr; reduction = :none, entropy = true)
    gl = rand(Float32, 6)
    want = FusedCE.cross_entropy_bwd(Xr, tr, r.lse; reduction = :none, grad_loss = gl, dlogits = fill(NaN32, 19, 6))
    h = FusedCE.default_handle()
    D = fill(NaN32, 19, 6)
    tl, tt, tlse, tent, tg, tdl = FusedCE.Tensor(Xr), FusedCE.Tensor(tr .- 1), FusedCE.Tensor(r.lse),
                                  FusedCE.Tensor(r.entropy), FusedCE.Tensor(gl), FusedCE.Tensor(D)
    GC.@preserve tl tt tlse tent tg tdl begin
        opts = FusedCE._ce_options(:none, -100, 0, 0, 0, 1, nothing)   # the binding's 0-based ignore_index
        # without grad_entropy: fce_cross_entropy_bwd's bits (entropy ignored)
        ins = FusedCE._cstruct(L.fce_ce_bwd_inputs_t; lse = FusedCE._ptr(tlse), grad_loss = FusedCE._ptr(tg),
                               entropy = FusedCE._ptr(tent))
        bytes = Ref{Csize_t}(typemax(Csize_t))
        @test L.fce_cross_entropy_bwd_ex_workspace_size(h.ptr, FusedCE._ptr(tl), FusedCE._ptr(tt), ins, opts,
                                                        FusedCE._ptr(tdl), bytes) == L.FCE_STATUS_SUCCESS
        @test bytes[] != typemax(Csize_t)
        @test L.fce_cross_entropy_bwd_ex(h.ptr, C_NULL, FusedCE._ptr(tl), FusedCE._ptr(tt), ins, opts,
                                         FusedCE._ptr(tdl), C_NULL, 0) == L.FCE_STATUS_SUCCESS
        @test D == want
        # NULL inputs, NULL inputs->lse: INVALID_ARGUMENT, dlogits untouched
        fill!(D, NaN32)
        @test L.fce_cross_entropy_bwd_ex(h.ptr, C_NULL, FusedCE._ptr(tl), FusedCE._ptr(tt),
                                         Ptr{L.fce_ce_bwd_inputs_t}(C_NULL), opts, FusedCE._ptr(tdl), C_NULL, 0) ==
              L.FCE_STATUS_INVALID_ARGUMENT
        nolse = FusedCE._cstruct(L.fce_ce_bwd_inputs_t; grad_loss = FusedCE._ptr(tg))
        @test L.fce_cross_entropy_bwd_ex(h.ptr, C_NULL, FusedCE._ptr(tl), FusedCE._ptr(tt), nolse, opts,
                                         FusedCE._ptr(tdl), C_NULL, 0) == L.FCE_STATUS_INVALID_ARGUMENT
        @test all(isnan, D)
    end
end

@testset "vocabulary-parallel cross-entropy" begin
    K = FusedCE.cross_entropy_record_fields()
    @test K == 9 == L.FCE_CE_RECORD_FIELDS_ALL
    @test (L.FCE_CE_RECORD_FIELDS_LOSS, L.FCE_CE_RECORD_FIELDS_ENTROPY) == (6, 7)
    Nv, Vv = 9, 47
    Xv = randn(Float32, Vv, Nv) .* 3
    tv = rand(1:Vv, Nv)
    tv[4] = -100                                   # an ignored row
    # two uneven shards, rows 1:17 and 18:47 of the V×N logits; the second padded by 3 rows of NaN
    s1 = Xv[1:17, :]
    s2 = vcat(Xv[18:47, :], fill(NaN32, 3, Nv))
    starts = (0, 17)                               # vocab_start: 0-based offset of each shard
    for kw in ((;), (reduction = :none, label_smoothing = 0.1, z_loss_scale = 1e-3),
               (reduction = :sum, softcap = 4.0, logit_scale = 0.8))
        ref = FusedCE.cross_entropy_fwd(Xv, tv; kw..., argmax = true, z_loss = true, entropy = true, dlogits = true)
        r1 = FusedCE.cross_entropy_partial(s1, tv; vocab_start = starts[1], vocab_total = Vv, kw...)
        r2 = FusedCE.cross_entropy_partial(s2, tv; vocab_start = starts[2], vocab_total = Vv, kw...)
        @test size(r1) == (K, Nv) && size(r2) == (K, Nv) && eltype(r1) == Float32
        # rows 5-6: each shard's column range [vocab_start, end) as Int32 bits (the padding not counted)
        @test all(reinterpret(Int32, r1[5:6, :]) .== Int32[0, 17]) && all(reinterpret(Int32, r2[5:6, :]) .== Int32[17, 47])
        recs = cat(r1, r2; dims = 3)               # K×N×W, rank order
        c = FusedCE.cross_entropy_combine(recs, tv; vocab_total = Vv, kw..., argmax = true, z_loss = true,
                                          entropy = true)
        cp = FusedCE.cross_entropy_combine(recs, tv; vocab_total = Vv, kw..., lse = :pair)
        @test size(cp.lse) == (2, Nv) && cp.loss == c.loss
        @test approx(lse_from_pairs(cp.lse), c.lse; rtol = 3e-7, atol = 0)
        @test approx(c.loss, ref.loss; rtol = 0, atol = 2e-5)
        @test approx(c.lse, ref.lse; rtol = 0, atol = 2e-5)
        @test approx(c.z_loss, ref.z_loss; rtol = 0, atol = 2e-5)
        @test approx(c.entropy, ref.entropy; rtol = 0, atol = 2e-5)
        @test c.argmax == ref.argmax && c.dlogits === nothing
        @test all(isfinite, c.lse)
        # each shard's gradient from the combined lse's pairs (and from its vector): its columns of the
        # unsharded gradient, 0 in the padding
        g = get(kw, :reduction, :mean) === :none ? rand(Float32, Nv) : 0.37f0
        dref = FusedCE.cross_entropy_bwd(Xv, tv, ref.lse; kw..., grad_loss = g)
        for l in (cp.lse, c.lse)
            d1 = FusedCE.cross_entropy_bwd(s1, tv, l; kw..., vocab_start = starts[1], vocab_total = Vv, grad_loss = g)
            d2 = FusedCE.cross_entropy_bwd(s2, tv, l; kw..., vocab_start = starts[2], vocab_total = Vv, grad_loss = g)
            @test approx(d1, dref[1:17, :]; rtol = 1e-5, atol = 1e-6)
            @test approx(d2[1:30, :], dref[18:47, :]; rtol = 1e-5, atol = 1e-6)
            @test all(d2[31:33, :] .== 0)
            @test all(d1[:, 4] .== 0) && all(d2[:, 4] .== 0)   # the ignored row
        end
        # the records written into a caller's buffer
        buf = Matrix{Float32}(undef, K, Nv)
        @test FusedCE.cross_entropy_partial(s1, tv; vocab_start = 0, vocab_total = Vv, records = buf, kw...) === buf
        @test buf == r1
    end
    # Int32 targets, Int32 argmax; a padded shard given as a view
    big = vcat(Xv[18:47, :], fill(NaN32, 3, Nv), randn(Float32, 2, Nv))
    rv = FusedCE.cross_entropy_partial(view(big, 1:33, :), Int32.(tv); vocab_start = 17, vocab_total = Vv)
    @test rv == FusedCE.cross_entropy_partial(s2, tv; vocab_start = 17, vocab_total = Vv)
    c32 = FusedCE.cross_entropy_combine(cat(FusedCE.cross_entropy_partial(s1, tv; vocab_start = 0, vocab_total = Vv),
                                            rv; dims = 3), Int32.(tv); vocab_total = Vv, argmax = true,
                                        argmax_type = Int32)
    @test eltype(c32.argmax) == Int32 && c32.argmax == ce_ref(Xv, tv).argmax
    @test approx(c32.loss, ce_ref(Xv, tv).loss; rtol = 0, atol = 2e-5)
    # errors
    function status_of(f)
        try
            f()
        catch e
            e isa FusedCEError || rethrow()
            return e.name
        end
        return "no error"
    end
    @test status_of(() -> FusedCE.cross_entropy_partial(s1, tv; vocab_start = 0, vocab_total = 0)) == "INVALID_ARGUMENT"
    @test status_of(() -> FusedCE.cross_entropy_partial(s1, tv; vocab_start = Vv + 1, vocab_total = Vv)) == "INVALID_ARGUMENT"
    # (vocab_start = vocab_total: a shard of padding alone, accepted; see "shard layouts")
    @test status_of(() -> FusedCE.cross_entropy_partial(s1, tv; vocab_start = Vv, vocab_total = Vv)) == "no error"
    @test status_of(() -> FusedCE.cross_entropy_partial(s1, tv[1:end-1]; vocab_start = 0, vocab_total = Vv)) == "SHAPE_MISMATCH"
    @test status_of(() -> FusedCE.cross_entropy_fwd(s1, tv; vocab_start = 0, vocab_total = Vv)) == "INVALID_ARGUMENT"
    recs = cat(FusedCE.cross_entropy_partial(s1, tv; vocab_start = 0, vocab_total = Vv),
               FusedCE.cross_entropy_partial(s2, tv; vocab_start = 17, vocab_total = Vv); dims = 3)
    @test status_of(() -> FusedCE.cross_entropy_combine(recs, tv; vocab_total = 0)) == "INVALID_ARGUMENT"
    @test status_of(() -> FusedCE.cross_entropy_combine(recs[1:K-1, :, :], tv; vocab_total = Vv)) == "SHAPE_MISMATCH"
    @test status_of(() -> FusedCE.cross_entropy_combine(recs, tv[1:end-1]; vocab_total = Vv)) == "SHAPE_MISMATCH"
    @test_throws UndefKeywordError FusedCE.cross_entropy_partial(s1, tv; vocab_total = Vv)
end

@testset "logsumexp" begin
    for scale in (1.0, 0.25, 3.0)
        @test approx(FusedCE.logsumexp(X; scale = scale), [lse64(scale .* Float64.(X[:, n])) for n in 1:N])
    end
    Y = copy(X); Y[:, 2] .= -Inf32
    @test FusedCE.logsumexp(Y)[2] == -Inf32
    @test approx(FusedCE.logsumexp(Float16.(X)), [lse64(Float64.(Float16.(X[:, n]))) for n in 1:N])
end

@testset "temp_softmax" begin
    for T in (1.0, 0.6, 2.5)
        r = FusedCE.temp_softmax(X; temperature = T, logprobs = true)
        for n in 1:N
            lp = logsoftmax64(Float64.(X[:, n]) ./ T)
            @test approx(r.probs[:, n], exp.(lp))
            @test approx(r.logprobs[:, n], lp)
        end
    end
    # greedy
    r = FusedCE.temp_softmax(X; temperature = 0, logprobs = true)
    for n in 1:N
        k = argmax(X[:, n])
        @test r.probs[:, n] == [j == k ? 1f0 : 0f0 for j in 1:V]
        @test r.logprobs[:, n] == [j == k ? 0f0 : -Inf32 for j in 1:V]
    end
    # per-row temperatures
    Ts = Float32.(range(0.5, 2.0; length = N))
    r = FusedCE.temp_softmax(X; temperatures = Ts)
    @test all(approx(r.probs[:, n], exp.(logsoftmax64(Float64.(X[:, n]) ./ Ts[n]))) for n in 1:N)
    # a row temperature < 0 gives NaN in that row only
    Ts[2] = -1
    r = FusedCE.temp_softmax(X; temperatures = Ts)
    @test all(isnan, r.probs[:, 2]) && !any(isnan, r.probs[:, 1])
    # logits' dtype out, and in place
    r = FusedCE.temp_softmax(Float16.(X); eltype = Float16)
    @test eltype(r.probs) == Float16
    Xc = copy(X)
    FusedCE.temp_softmax(Xc; probs = Xc)
    @test approx(Xc, FusedCE.temp_softmax(X).probs; atol = 0, rtol = 0)
    @test r.logprobs === nothing
end

@testset "vocabulary-parallel logsumexp and temperature softmax" begin
    KL = L.FCE_LSE_RECORD_FIELDS
    @test KL == 6
    # the grown option structs: the new fields' defaults are 0/0/NULL, and the builders fill them
    dl, ds = FusedCE.defaults(L.fce_lse_options_t), FusedCE.defaults(L.fce_softmax_options_t)
    @test (dl.vocab_start, dl.vocab_total) == (0, 0)
    @test (ds.vocab_start, ds.vocab_total, ds.lse) == (0, 0, C_NULL)
    o = FusedCE._lse_options(0.5; vocab_start = 3, vocab_total = 9)[]
    @test (o.scale, o.vocab_start, o.vocab_total, o.struct_size) == (0.5f0, 3, 9, sizeof(L.fce_lse_options_t))
    @test FusedCE._lse_options(2.0)[] == L.fce_lse_options_t(sizeof(L.fce_lse_options_t), 2.0f0, 0, 0)
    # the first published sizes (0.1's structs, which ended before vocab_start) still get the defaults
    for (T, init, first) in ((L.fce_lse_options_t, L.fce_lse_options_init, 8),
                             (L.fce_softmax_options_t, L.fce_softmax_options_init, 16))
        @test Int(fieldoffset(T, findfirst(==(:vocab_start), fieldnames(T)))) == first
        buf = fill(0xab, sizeof(T) + 8)
        GC.@preserve buf begin
            @test init(Ptr{T}(pointer(buf)), first) == L.FCE_STATUS_SUCCESS
            @test unsafe_load(Ptr{UInt32}(pointer(buf))) == first && all(==(0xab), buf[first+1:end])
            @test init(Ptr{T}(pointer(buf)), first - 4) == L.FCE_STATUS_INVALID_ARGUMENT
        end
    end

    Vs, Ns, Tm = 47, 6, 0.8
    Xs = randn(Float32, Vs, Ns) .* 3
    Xs[5, 2] = -Inf32                              # a masked class: probability 0 everywhere
    ref_lse = FusedCE.logsumexp(Xs; scale = 1 / Tm)
    ref_sm = FusedCE.temp_softmax(Xs; temperature = Tm, logprobs = true)
    lse_f64 = [lse64(Float64.(Xs[:, n]) ./ Tm) for n in 1:Ns]
    @test approx(ref_lse, lse_f64; rtol = 1e-6, atol = 1e-6)
    # shards: (rows of the V×N matrix, padding rows of NaN after them), in rank order
    pad(rows, p) = vcat(Xs[rows, :], fill(NaN32, p, Ns))
    for (name, shards) in ("17 + 30" => ((1:17, 0), (18:47, 0)),
                           "17 + 30, the last padded by 3 NaN rows" => ((1:17, 0), (18:47, 3)))
        starts = [first(rows) - 1 for (rows, _) in shards]     # vocab_start: 0-based offset of each shard
        xs = [pad(rows, p) for (rows, p) in shards]
        # step 1: each shard's records (scale 1/T), into a poisoned buffer
        recs = [FusedCE.logsumexp_partial(xs[r]; vocab_start = starts[r], vocab_total = Vs, scale = 1 / Tm,
                                          records = fill(NaN32, KL, Ns)) for r in eachindex(shards)]
        @test all(r -> size(r) == (KL, Ns) && eltype(r) == Float32, recs)
        # m = max x (raw), d = sum exp((x - m) s), s = 1 / T; the column range, s and vocab_total
        sc = Float32(1 / Tm)
        for (r, (rows, _)) in enumerate(shards), n in 1:Ns
            x = Float64.(Xs[rows, n])
            @test approx(recs[r][1:2, n], [maximum(x), sum(exp.((x .- maximum(x)) .* sc))]; rtol = 1e-5, atol = 1e-6)
            @test reinterpret(Int32, recs[r][3:4, n]) == Int32[first(rows) - 1, last(rows)]
            @test recs[r][5, n] === sc && reinterpret(Int32, recs[r][6, n]) == Vs
        end
        @test FusedCE.logsumexp_partial(xs[1]; vocab_start = starts[1], vocab_total = Vs, scale = 1 / Tm) == recs[1]
        stacked = cat(recs...; dims = 3)               # 2×N×W, rank order
        @test size(stacked) == (KL, Ns, length(shards))
        # step 3: the whole columns' lse, against the unsharded logsumexp and Float64
        c = FusedCE.logsumexp_combine(stacked)
        @test c isa Vector{Float32} && length(c) == Ns
        @test all(isapprox.(c, ref_lse; rtol = 1e-6, atol = 1e-6))
        @test approx(c, lse_f64; rtol = 1e-6, atol = 1e-6)
        out = fill(NaN32, Ns)
        @test FusedCE.logsumexp_combine(stacked; out = out) === out && out == c
        # its pairs (M, log D), M the raw max: lse = M / T + log D
        cpair = FusedCE.logsumexp_combine(stacked; out = :pair)
        @test cpair isa Matrix{Float32} && size(cpair) == (2, Ns)
        @test cpair[1, :] == vec(maximum(Xs; dims = 1))
        @test approx(lse_from_pairs(cpair; scale = sc), c; rtol = 3e-7, atol = 0)
        outp = fill(NaN32, 2, Ns)
        @test FusedCE.logsumexp_combine(stacked; out = outp) === outp && outp == cpair
        # each shard's softmax from that lse, its pairs and its vector (poisoned buffers): its rows of the
        # unsharded softmax, the padding exactly 0 / -Inf
        for (r, (rows, p)) in enumerate(shards), c in (cpair, c)
            sm = FusedCE.temp_softmax(xs[r]; temperature = Tm, vocab_start = starts[r], vocab_total = Vs, lse = c,
                                      probs = fill(NaN32, size(xs[r])), logprobs = fill(NaN32, size(xs[r])))
            k = length(rows)
            @test size(sm.probs) == (k + p, Ns) && eltype(sm.probs) == Float32
            @test all(isapprox.(sm.probs[1:k, :], ref_sm.probs[rows, :]; rtol = 1e-5, atol = 1e-7))
            @test all(isapprox.(sm.logprobs[1:k, :], ref_sm.logprobs[rows, :]; rtol = 1e-5, atol = 1e-5))
            @test all(sm.probs[k+1:end, :] .=== 0.0f0) && all(sm.logprobs[k+1:end, :] .== -Inf32)
            # one output alone, allocated
            lp = FusedCE.temp_softmax(xs[r]; temperature = Tm, vocab_start = starts[r], vocab_total = Vs, lse = c,
                                      probs = false, logprobs = true)
            @test lp.probs === nothing && lp.logprobs == sm.logprobs
        end
        # the shards' probabilities make up whole distributions
        full = vcat([FusedCE.temp_softmax(xs[r]; temperature = Tm, vocab_start = starts[r], vocab_total = Vs,
                                          lse = c).probs[1:length(rows), :] for (r, (rows, _)) in enumerate(shards)]...)
        @test all(isapprox.(sum(Float64.(full); dims = 1), 1; atol = 1e-5))
    end
    # a padded shard given as a view of a larger matrix
    big = vcat(Xs[18:47, :], fill(NaN32, 3, Ns), randn(Float32, 2, Ns))
    @test FusedCE.logsumexp_partial(view(big, 1:33, :); vocab_start = 17, vocab_total = Vs, scale = 1 / Tm) ==
          FusedCE.logsumexp_partial(big[1:33, :]; vocab_start = 17, vocab_total = Vs, scale = 1 / Tm)
    # errors
    function status_of(f)
        try
            f()
        catch e
            e isa FusedCEError || rethrow()
            return e.name
        end
        return "no error"
    end
    s1, s2 = Xs[1:17, :], vcat(Xs[18:47, :], fill(NaN32, 3, Ns))
    c = FusedCE.logsumexp_combine(cat(FusedCE.logsumexp_partial(s1; vocab_start = 0, vocab_total = Vs, scale = 1 / Tm),
                                      FusedCE.logsumexp_partial(s2; vocab_start = 17, vocab_total = Vs, scale = 1 / Tm);
                                      dims = 3))
    shard_sm(; kw...) = FusedCE.temp_softmax(s2; temperature = Tm, vocab_start = 17, vocab_total = Vs, lse = c, kw...)
    @test status_of(() -> shard_sm()) == "no error"
    cpair = FusedCE.logsumexp_combine(cat(FusedCE.logsumexp_partial(s1; vocab_start = 0, vocab_total = Vs, scale = 1 / Tm),
                                          FusedCE.logsumexp_partial(s2; vocab_start = 17, vocab_total = Vs, scale = 1 / Tm);
                                          dims = 3); out = :pair)
    @test status_of(() -> shard_sm(lse = cpair)) == "no error"
    @test isapprox(shard_sm(lse = cpair).probs, shard_sm().probs; rtol = 1e-5)
    @test status_of(() -> shard_sm(lse = cpair[:, 1:end-1])) == "SHAPE_MISMATCH"
    @test status_of(() -> shard_sm(lse = Float64.(cpair))) == "UNSUPPORTED_DTYPE"
    @test status_of(() -> shard_sm(lse = view(vcat(cpair, cpair), 1:2, :))) == "UNSUPPORTED_LAYOUT"
    @test status_of(() -> shard_sm(temperature = 0)) == "NOT_IMPLEMENTED"
    @test status_of(() -> shard_sm(temperature = Inf)) == "NOT_IMPLEMENTED"
    @test status_of(() -> shard_sm(temperatures = fill(Float32(Tm), Ns))) == "NOT_IMPLEMENTED"
    @test status_of(() -> shard_sm(lse = nothing)) == "INVALID_ARGUMENT"
    @test status_of(() -> shard_sm(lse = c[1:end-1])) == "SHAPE_MISMATCH"
    @test status_of(() -> shard_sm(vocab_start = Vs + 1)) == "INVALID_ARGUMENT"
    # a shard of padding alone: probabilities 0
    @test all(shard_sm(vocab_start = Vs).probs .=== 0.0f0)
    @test status_of(() -> FusedCE.temp_softmax(s1; vocab_start = 3)) == "INVALID_ARGUMENT"   # a start without a shard
    @test status_of(() -> FusedCE.logsumexp_partial(s1; vocab_start = 0, vocab_total = 0)) == "INVALID_ARGUMENT"
    @test status_of(() -> FusedCE.logsumexp_partial(s1; vocab_start = Vs + 1, vocab_total = Vs)) == "INVALID_ARGUMENT"
    @test status_of(() -> FusedCE.logsumexp_partial(s1; vocab_start = 0, vocab_total = Vs, scale = 0)) == "INVALID_ARGUMENT"
    @test status_of(() -> FusedCE.logsumexp_partial(s1; vocab_start = 0, vocab_total = Vs,
                                                    records = zeros(Float32, KL + 1, Ns))) == "SHAPE_MISMATCH"
    recs = cat(FusedCE.logsumexp_partial(s1; vocab_start = 0, vocab_total = Vs),
               FusedCE.logsumexp_partial(s2; vocab_start = 17, vocab_total = Vs); dims = 3)
    @test status_of(() -> FusedCE.logsumexp_combine(recs[1:1, :, :])) == "SHAPE_MISMATCH"
    @test status_of(() -> FusedCE.logsumexp_combine(recs; out = zeros(Float32, Ns + 1))) == "SHAPE_MISMATCH"
    @test status_of(() -> FusedCE.logsumexp_combine(recs; out = zeros(Float32, 3, Ns))) == "SHAPE_MISMATCH"
    @test status_of(() -> FusedCE.logsumexp_combine(recs; out = view(zeros(Float32, 3, Ns), 1:2, :))) ==
          "UNSUPPORTED_LAYOUT"
    @test_throws ArgumentError FusedCE.logsumexp_combine(recs; out = :pairs)
    @test status_of(() -> FusedCE.logsumexp_combine(view(recs, :, 1:2:Ns, :))) == "UNSUPPORTED_LAYOUT"
    @test_throws UndefKeywordError FusedCE.logsumexp_partial(s1; vocab_total = Vs)
end

S = randn(Float32, V, N) .* 2
Tt = randn(Float32, V, N) .* 2
kt = rand(1:V, N); kt[4] = -100

@testset "kd_loss $(keys(kw)) $(values(kw))" for kw in (
        (;),
        (divergence = :reverse_kl,),
        (divergence = :jsd,),
        (divergence = :jsd, beta = 0.2),
        (divergence = :jsd, beta = 0.0),
        (divergence = :jsd, beta = 1.0),
        (temperature = 2.0, scale_by_t2 = true),
        (reduction = :sum, temperature = 0.7),
        (reduction = :none, divergence = :reverse_kl))
    for targets in (nothing, kt)
        ref = kd_ref(S, Tt; targets = targets, kw...)
        r = FusedCE.kd_loss(S, Tt; targets = targets, dstudent = true, kw...)
        @test approx(r.loss, ref)
        G = fd_grad(Sd -> kd_ref(Sd, Tt; targets = targets, kw...), Float64.(S))
        @test approx(r.dstudent, G; atol = 1e-5, rtol = 1e-4)
    end
    g = get(kw, :reduction, :mean) === :none ? rand(Float32, N) : 1.7f0
    r = FusedCE.kd_loss(S, Tt; dstudent = true, grad_loss = g, kw...)
    G = fd_grad(Sd -> kd_ref(Sd, Tt; kw...), Float64.(S); g = Float64.(g))
    @test approx(r.dstudent, G; atol = 1e-5, rtol = 1e-4)
end

@testset "kd_loss_topk $(keys(kw)) $(values(kw))" for kw in (
        (;),
        (topk_norm = :renormalize,),
        (divergence = :reverse_kl,),
        (divergence = :reverse_kl, topk_norm = :renormalize),
        (divergence = :jsd, beta = 0.4, temperature = 1.5),
        (reduction = :none, scale_by_t2 = true, temperature = 2.0))
    K = 4
    ids = zeros(Int, K, N)
    for n in 1:N
        ids[:, n] = randperm(V)[1:K]
    end
    ids[4, 2] = 0            # an unused slot
    ids[:, 5] .= 0           # a row with no used slot: masked
    lps = Float32.(log.(rand(K, N) .* 0.2))
    ref = kd_topk_ref(S, ids, lps; kw...)
    r = FusedCE.kd_loss_topk(S, ids, lps; dstudent = true, kw...)
    @test approx(r.loss, ref)
    G = fd_grad(Sd -> kd_topk_ref(Sd, ids, lps; kw...), Float64.(S))
    @test approx(r.dstudent, G; atol = 1e-5, rtol = 1e-4)
    @test all(r.dstudent[:, 5] .== 0)
    r32 = FusedCE.kd_loss_topk(S, Int32.(ids), lps; kw...)
    @test r32.loss == r.loss
    i32 = Int32.(ids)
    i32[4, 2] = typemin(Int32)                     # any id ≤ 0 is an unused slot: none wraps around
    @test FusedCE.kd_loss_topk(S, i32, lps; kw...).loss == r.loss
end

@testset "vocabulary-parallel knowledge distillation" begin
    KR, KS = L.FCE_KD_RECORD_FIELDS, L.FCE_KD_ROW_STATS_FIELDS
    @test KR == 7 && KS == 5
    Vk, Nk = 53, 7
    Sk = randn(Float32, Vk, Nk) .* 2
    Tk = randn(Float32, Vk, Nk) .* 2
    tk = rand(1:Vk, Nk)
    tk[3] = -100                                   # a masked column
    # shards: (rows of the V×N logits, padding rows of NaN after them), in rank order
    layouts = ("20 + 33" => ((1:20, 0), (21:53, 0)),
               "20 + 33, the last padded by 4 NaN rows" => ((1:20, 0), (21:53, 4)),
               "18 + 18 + 17, the last padded by 1 NaN row" => ((1:18, 0), (19:36, 0), (37:53, 1)))
    pad(X, rows, p) = vcat(X[rows, :], fill(NaN32, p, size(X, 2)))
    # the status name of the FusedCEError that f throws (from C function func)
    function kd_status(f, func)
        try
            f()
        catch e
            e isa FusedCEError || rethrow()
            @test e.func === func
            @test !isempty(e.message)
            return e.name
        end
        return "no error"
    end
    lse_cols(X, T) = [lse64(Float64.(X[:, n]) ./ T) for n in 1:size(X, 2)]
    # a shard's record in Float64 (header: m_P, sum exp(z_P - m_P), m_Q, sum exp(z_Q - m_Q), X; then its
    # column range, rows 6-7)
    function kd_record64(P, Q, T)
        zp, zq = Float64.(P) ./ T, Float64.(Q) ./ T
        mp, mq = maximum(zp), maximum(zq)
        ep = exp.(zp .- mp)
        return [mp, sum(ep), mq, sum(exp.(zq .- mq)), sum(ep .* ((zp .- mp) .- (zq .- mq)))]
    end
    KT = L.FCE_KD_TERMS_RECORD_FIELDS
    @test KT == 5
    # JSD strictly between forward and reverse KL: two exchanges
    mixture(kw) = get(kw, :divergence, :forward_kl) === :jsd && 0 < get(kw, :beta, 0.5) < 1
    # a shard's terms' record in Float64 (header: sum L_j, sum a_j over its columns; the count of field 3 is
    # not formed here), from the whole rows' log-probabilities lp (teacher) and lq (student) at the shard's
    # columns (a top-K teacher: at its ids in the shard)
    function kd_terms64(lp, lq, divergence, beta)
        p, q = exp.(lp), exp.(lq)
        a = divergence === :forward_kl ? -p :
            divergence === :reverse_kl ? q .* (lq .- lp) .+ q :
            (1 - beta) .* q .* (lq .- log.(beta .* p .+ (1 - beta) .* q))
        return [kd_row_terms(lp, lq, divergence, beta), sum(a)]
    end
    # JSD's A and d(loss)/d(student logits) in Float64: with z = logits / T, M = b*P + (1-b)*Q (P the teacher),
    # S = sum_k q_k log(q_k / m_k), A = (1-b) S and d/dz_j = (1-b) q_j (log(q_j / m_j) - S); divided by T for
    # the logits, times T^2 with scale_by_t2, 1/(unmasked columns) for :mean, grad_loss; 0 at masked columns
    function jsd_grad64(X, Y; beta, temperature = 1.0, scale_by_t2 = false, reduction = :mean, targets = nothing,
                        ignore_index = -100, grad_loss = 1.0, kw...)
        V, N = size(X)
        masked = [targets !== nothing && targets[n] == ignore_index for n in 1:N]
        scale = (scale_by_t2 ? temperature^2 : 1.0) / temperature /
                (reduction === :mean ? max(count(!, masked), 1) : 1)
        A, G = zeros(N), zeros(V, N)
        for n in 1:N
            lq = logsoftmax64(Float64.(X[:, n]) ./ temperature)
            lp = logsoftmax64(Float64.(Y[:, n]) ./ temperature)
            q = exp.(lq)
            lqm = lq .- log.(beta .* exp.(lp) .+ (1 - beta) .* q)   # log(q_j / m_j)
            s = sum(q .* lqm)
            A[n] = (1 - beta) * s
            g = grad_loss isa AbstractVector ? Float64(grad_loss[n]) : Float64(grad_loss)
            masked[n] || (G[:, n] = (1 - beta) .* q .* (lqm .- s) .* (scale * g))
        end
        return (A = A, dstudent = G)
    end
    # the reference checked against central differences of kd_ref once
    let kwj = (beta = 0.3, temperature = 1.5, scale_by_t2 = true, reduction = :mean, targets = tk)
        G = fd_grad(X -> kd_ref(X, Tk; divergence = :jsd, kwj...), Float64.(Sk))
        @test approx(jsd_grad64(Sk, Tk; kwj...).dstudent, G; atol = 1e-7, rtol = 1e-6)
    end
    # steps 3 to 3c of whole rows: kd_combine, then for JSD and a top-K teacher the terms' exchange; ts the
    # shards' teacher logits, or a top-K teacher's (ids, logprobs), the same on every shard; (loss, row_stats)
    function kd_vp_combine(stacked, ss, ts, starts; targets = nothing, kw...)
        topk = ts isa Tuple
        mixture(kw) || topk || return FusedCE.kd_combine(stacked; vocab_total = Vk, targets = targets, kw...)
        c = FusedCE.kd_combine(stacked; vocab_total = Vk, targets = targets, kw..., loss = false)
        trecs = [FusedCE.kd_terms_partial(ss[r], (topk ? ts : (ts[r],))..., c.row_stats; vocab_start = starts[r],
                                          vocab_total = Vk, kw...) for r in eachindex(ss)]
        return FusedCE.kd_terms_combine(cat(trecs...; dims = 3), c.row_stats; vocab_total = Vk, targets = targets,
                                        kw...)
    end
    for (name, shards) in layouts, kw in ((divergence = :forward_kl, reduction = :none),
                                          (divergence = :forward_kl, reduction = :mean),
                                          (divergence = :reverse_kl, reduction = :none),
                                          (divergence = :reverse_kl, reduction = :mean),
                                          (divergence = :forward_kl, reduction = :mean, temperature = 2.0,
                                           scale_by_t2 = true),
                                          (divergence = :reverse_kl, reduction = :none, temperature = 0.7),
                                          (divergence = :jsd, beta = 0.5, reduction = :none),
                                          (divergence = :jsd, beta = 0.2, reduction = :mean, temperature = 2.0,
                                           scale_by_t2 = true),
                                          (divergence = :jsd, beta = 0.7, reduction = :sum, temperature = 0.7))
        T = Float64(get(kw, :temperature, 1.0))
        rev = kw.divergence === :reverse_kl            # JSD's record is forward KL's (P the teacher)
        jsd = mixture(kw)
        starts = [first(rows) - 1 for (rows, _) in shards]     # vocab_start: 0-based offset of each shard
        ss = [pad(Sk, rows, p) for (rows, p) in shards]
        ts = [pad(Tk, rows, p) for (rows, p) in shards]
        # step 1: each shard's records, into a poisoned buffer
        recs = [FusedCE.kd_partial(ss[r], ts[r]; vocab_start = starts[r], vocab_total = Vk, kw...,
                                   records = fill(NaN32, KR, Nk)) for r in eachindex(shards)]
        @test all(r -> size(r) == (KR, Nk) && eltype(r) == Float32, recs)
        for (r, (rows, _)) in enumerate(shards), n in 1:Nk
            P, Q = rev ? (Sk[rows, n], Tk[rows, n]) : (Tk[rows, n], Sk[rows, n])
            @test approx(recs[r][1:5, n], kd_record64(P, Q, T); rtol = 1e-5, atol = 1e-5)
            @test reinterpret(Int32, recs[r][6:7, n]) == Int32[first(rows) - 1, last(rows)]
        end
        @test FusedCE.kd_partial(ss[1], ts[1]; vocab_start = starts[1], vocab_total = Vk, kw...) == recs[1]
        stacked = cat(recs...; dims = 3)               # 7×N×W, rank order
        @test size(stacked) == (KR, Nk, length(shards))
        for targets in (nothing, tk)
            g = kw.reduction === :none ? rand(Float32, Nk) .+ 0.5f0 : 1.7f0
            ref = FusedCE.kd_loss(Sk, Tk; targets = targets, dstudent = true, grad_loss = g, kw...)
            @test maximum(abs, ref.dstudent) > 1e-3   # far above the gradient's atol
            # step 3: the whole rows' loss and statistics (poisoned buffer); JSD: the statistics only, A NaN
            c = FusedCE.kd_combine(stacked; vocab_total = Vk, targets = targets, kw..., loss = !jsd,
                                   row_stats = fill(NaN32, KS, Nk))
            @test size(c.row_stats) == (KS, Nk) && eltype(c.row_stats) == Float32
            jsd && @test c.loss === nothing && all(isnan, c.row_stats[5, :])
            # step 3a: each shard's terms' records (poisoned buffer), against Float64
            trecs = [FusedCE.kd_terms_partial(ss[r], ts[r], c.row_stats; vocab_start = starts[r], vocab_total = Vk,
                                              kw..., records = fill(NaN32, KT, Nk)) for r in eachindex(shards)]
            @test all(r -> size(r) == (KT, Nk) && eltype(r) == Float32, trecs)
            for (r, (rows, _)) in enumerate(shards), n in 1:Nk
                lq = logsoftmax64(Float64.(Sk[:, n]) ./ T)[rows]
                lp = logsoftmax64(Float64.(Tk[:, n]) ./ T)[rows]
                @test approx(trecs[r][1:2, n], kd_terms64(lp, lq, kw.divergence, get(kw, :beta, 0.5)))
                @test trecs[r][3, n] == -1                     # no slots: teacher logits
                @test reinterpret(Int32, trecs[r][4:5, n]) == Int32[first(rows) - 1, last(rows)]
            end
            # steps 3b-3c: the loss and A into a copy of the statistics, fields 1-4 kept; for KL the loss
            # and A of step 3 a second way
            st = copy(c.row_stats)
            tc = FusedCE.kd_terms_combine(cat(trecs...; dims = 3), st; vocab_total = Vk, targets = targets, kw...)
            @test tc.row_stats === st && st[1:4, :] == c.row_stats[1:4, :]
            if !jsd
                @test approx(tc.loss, c.loss; rtol = 2e-5, atol = 1e-6)
                @test approx(st[5, :], c.row_stats[5, :]; rtol = 2e-5, atol = 1e-6)
            end
            loss, stats = jsd ? (tc.loss, st) : (c.loss, c.row_stats)
            @test all(isapprox.(loss, ref.loss; rtol = 2e-5, atol = 0))
            @test approx(loss, kd_ref(Sk, Tk; targets = targets, kw...))     # the Float64 reference too
            unmasked = targets === nothing ? (1:Nk) : [1, 2, 4, 5, 6, 7]
            kw.reduction === :none && @test loss isa Vector{Float32} && all(>(0), loss[unmasked])
            kw.reduction === :none || @test loss isa Float32
            targets === nothing || kw.reduction !== :none || @test loss[3] == 0
            # row statistics: M + log D is each distribution's lse of z = logits / T; A = -1 (forward KL),
            # the row's KL + 1 (reverse KL) or (1 - beta) sum_k q_k log(q_k / m_k) (JSD; unscaled, every row)
            @test approx(stats[1, :] .+ stats[2, :], lse_cols(Sk, T))
            @test approx(stats[3, :] .+ stats[4, :], lse_cols(Tk, T))
            @test approx(stats[5, :], jsd ? jsd_grad64(Sk, Tk; kw...).A :
                                      rev ? kd_ref(Sk, Tk; divergence = :reverse_kl, temperature = T,
                                                   reduction = :none) .+ 1 : fill(-1.0, Nk))
            ref64 = jsd ? jsd_grad64(Sk, Tk; targets = targets, grad_loss = g, kw...).dstudent : nothing
            # step 4: each shard's dstudent (poisoned buffer): its rows of the unsharded gradient (JSD: and of
            # the Float64 one), 0 in the padding
            for (r, (rows, p)) in enumerate(shards)
                d = FusedCE.kd_bwd(ss[r], ts[r], stats; vocab_start = starts[r], vocab_total = Vk,
                                   targets = targets, grad_loss = g, kw..., dstudent = fill(NaN32, size(ss[r])))
                @test all(isapprox.(d[1:length(rows), :], ref.dstudent[rows, :]; rtol = 1e-4, atol = 1e-6))
                jsd && @test approx(d[1:length(rows), :], ref64[rows, :]; rtol = 1e-4, atol = 1e-6)
                @test all(d[length(rows)+1:end, :] .== 0)
                p > 0 && @test size(d, 1) == length(rows) + p
                targets === nothing || @test all(d[:, 3] .== 0)
            end
        end
        # grad_loss defaults to 1; the gradient in place, into the student's memory; row_stats not asked for
        ref1 = FusedCE.kd_loss(Sk, Tk; dstudent = true, kw...)
        c1 = kd_vp_combine(stacked, ss, ts, starts; kw...)
        if !jsd
            c0 = FusedCE.kd_combine(stacked; vocab_total = Vk, kw..., row_stats = false)
            @test c0.row_stats === nothing && c0.loss == c1.loss
            # KL's combine without its loss (the C loss NULL): the same statistics, A complete; without
            # row_stats either it is refused
            cs = FusedCE.kd_combine(stacked; vocab_total = Vk, kw..., loss = false)
            @test cs.loss === nothing && cs.row_stats == c1.row_stats
            @test kd_status(() -> FusedCE.kd_combine(stacked; vocab_total = Vk, kw..., loss = false, row_stats = false),
                            :fce_kd_combine) == "INVALID_ARGUMENT"
        end
        r = length(shards)
        rows = shards[r][1]
        d1 = FusedCE.kd_bwd(ss[r], ts[r], c1.row_stats; vocab_start = starts[r], vocab_total = Vk, kw...)
        @test all(isapprox.(d1[1:length(rows), :], ref1.dstudent[rows, :]; rtol = 1e-4, atol = 1e-6))
        sc = copy(ss[r])
        @test FusedCE.kd_bwd(sc, ts[r], c1.row_stats; vocab_start = starts[r], vocab_total = Vk, kw...,
                             dstudent = sc) === sc
        @test sc == d1
    end

    # A top-K teacher over shards: K×N 1-based ids into the whole vocabulary (≤ 0 unused) and Float32
    # log-probabilities, the same arrays on every shard; always two exchanges (kd_combine with loss = false).
    # Against kd_loss_topk of the whole rows and the Float64 kd_topk_ref (its gradient by central differences).
    Kk = 6
    idk = zeros(Int, Kk, Nk)
    for n in 1:Nk
        idk[:, n] = randperm(Vk)[1:Kk]
    end
    idk[2, 1] = 0; idk[5, 2] = -3                  # unused slots
    idk[:, 5] .= 0                                 # no used slot: masked (loss 0, not counted by :mean, gradient 0)
    idk[:, 6] = randperm(17)[1:Kk]                 # every id in the first shard of each layout
    idk[1, 7] = Vk                                 # the last class
    lpk = Float32.(log.(rand(Kk, Nk) .* 0.2 .+ 1e-3))
    usedk = [n for n in 1:Nk if any(>=(1), idk[:, n])]
    @test usedk == [1, 2, 3, 4, 6, 7]
    topk_kws = ((divergence = :forward_kl, topk_norm = :full_vocab, reduction = :none),
                (divergence = :forward_kl, topk_norm = :renormalize, reduction = :mean, temperature = 2.0,
                 scale_by_t2 = true),
                (divergence = :reverse_kl, topk_norm = :full_vocab, reduction = :mean),
                (divergence = :reverse_kl, topk_norm = :renormalize, reduction = :none, temperature = 0.7),
                (divergence = :jsd, beta = 0.3, topk_norm = :full_vocab, reduction = :sum, temperature = 1.5),
                (divergence = :jsd, beta = 0.6, topk_norm = :renormalize, reduction = :none))
    @testset "top-K teacher, $name, $(values(kw))" for (name, shards) in layouts, kw in topk_kws
        T = Float64(get(kw, :temperature, 1.0))
        beta = get(kw, :beta, 0.5)
        rev = kw.divergence === :reverse_kl
        starts = [first(rows) - 1 for (rows, _) in shards]
        ss = [pad(Sk, rows, p) for (rows, p) in shards]
        cols = [topk_column64(Sk, idk, lpk, n; temperature = T, topk_norm = kw.topk_norm) for n in 1:Nk]
        # step 1 (poisoned buffers): the student's max and sum over the shard's real columns and over its columns
        # at the teacher's ids in the shard (Q's fields and P's; reverse KL the other way round), X NaN
        recs = [FusedCE.kd_partial(ss[r], idk, lpk; vocab_start = starts[r], vocab_total = Vk, kw...,
                                   records = fill(NaN32, KR, Nk)) for r in eachindex(shards)]
        whole, sel = rev ? (1, 3) : (3, 1)
        for (r, (rows, _)) in enumerate(shards), n in 1:Nk
            rec = Float64.(recs[r][:, n])
            @test isapprox(rec[whole] + log(rec[whole+1]), lse64(Float64.(Sk[rows, n]) ./ T); rtol = 1e-5)
            ins = filter(in(rows), cols[n].ids)
            isempty(ins) || @test isapprox(rec[sel] + log(rec[sel+1]), lse64(Float64.(Sk[ins, n]) ./ T); rtol = 1e-5)
            @test isnan(rec[5])
        end
        stacked = cat(recs...; dims = 3)
        for targets in (nothing, tk)
            g = kw.reduction === :none ? rand(Float32, Nk) .+ 0.5f0 : 1.7f0
            ref = FusedCE.kd_loss_topk(Sk, idk, lpk; targets = targets, dstudent = true, grad_loss = g, kw...)
            masked = [n == 5 || (targets !== nothing && targets[n] == -100) for n in 1:Nk]
            # step 3, the statistics only: the student's M + log D over the whole row, and over the teacher's ids
            c = FusedCE.kd_combine(stacked; vocab_total = Vk, targets = targets, kw..., loss = false,
                                   row_stats = fill(NaN32, KS, Nk))
            @test c.loss === nothing
            @test approx(c.row_stats[1, :] .+ c.row_stats[2, :], lse_cols(Sk, T))
            @test approx((c.row_stats[3, :] .+ c.row_stats[4, :])[usedk],
                         [lse64(Float64.(Sk[cols[n].ids, n]) ./ T) for n in usedk])
            # step 3a (poisoned buffers): each shard's sums over the used slots whose ids fall in it, and their number
            trecs = [FusedCE.kd_terms_partial(ss[r], idk, lpk, c.row_stats; vocab_start = starts[r], vocab_total = Vk,
                                              kw..., records = fill(NaN32, KT, Nk)) for r in eachindex(shards)]
            for (r, (rows, _)) in enumerate(shards), n in 1:Nk
                k = findall(in(rows), cols[n].ids)
                @test trecs[r][3, n] == length(k)
                @test approx(trecs[r][1:2, n], kd_terms64(cols[n].lp[k], cols[n].lq[k], kw.divergence, beta))
            end
            # steps 3b-3c: the loss, and A into the statistics (fields 1-4 kept)
            st = copy(c.row_stats)
            tc = FusedCE.kd_terms_combine(cat(trecs...; dims = 3), st; vocab_total = Vk, targets = targets, kw...)
            @test tc.row_stats === st && isequal(st[1:4, :], c.row_stats[1:4, :])
            @test all(isapprox.(tc.loss, ref.loss; rtol = 2e-5, atol = 0))
            @test approx(tc.loss, kd_topk_ref(Sk, idk, lpk; targets = targets, kw...))
            kw.reduction === :none && @test tc.loss[masked] == zeros(count(masked))
            live = [n for n in usedk if !masked[n]]
            @test approx(st[5, live], [kd_terms64(cols[n].lp, cols[n].lq, kw.divergence, beta)[2] for n in live])
            # step 4 (poisoned buffers): each shard's rows of kd_loss_topk's gradient and of the Float64 one, 0 in
            # the padding and at masked columns (with :renormalize also off the teacher's ids)
            G = fd_grad(X -> kd_topk_ref(X, idk, lpk; targets = targets, kw...), Float64.(Sk); g = Float64.(g))
            for (r, (rows, p)) in enumerate(shards)
                d = FusedCE.kd_bwd(ss[r], idk, lpk, st; vocab_start = starts[r], vocab_total = Vk, targets = targets,
                                   grad_loss = g, kw..., dstudent = fill(NaN32, size(ss[r])))
                @test all(isapprox.(d[1:length(rows), :], ref.dstudent[rows, :]; rtol = 1e-4, atol = 1e-6))
                @test approx(d[1:length(rows), :], G[rows, :]; atol = 1e-5, rtol = 1e-4)
                @test all(d[length(rows)+1:end, :] .== 0)
                @test all(d[:, masked] .== 0)
                kw.topk_norm === :renormalize &&
                    @test all(d[i, n] == 0 for i in eachindex(rows), n in 1:Nk if !(rows[i] in cols[n].ids))
            end
        end
        # Int32 ids give the same bits; the steps of kd_vp_combine; grad_loss 1, in place
        c1 = kd_vp_combine(stacked, ss, (idk, lpk), starts; kw...)
        i32 = Int32.(idk)
        @test isequal(FusedCE.kd_partial(ss[end], i32, lpk; vocab_start = starts[end], vocab_total = Vk, kw...),
                      recs[end])
        c32 = kd_vp_combine(cat((FusedCE.kd_partial(ss[r], i32, lpk; vocab_start = starts[r], vocab_total = Vk, kw...)
                                 for r in eachindex(shards))...; dims = 3), ss, (i32, lpk), starts; kw...)
        @test isequal(c32.loss, c1.loss) && isequal(c32.row_stats, c1.row_stats)
        ref1 = FusedCE.kd_loss_topk(Sk, idk, lpk; dstudent = true, kw...)
        @test all(isapprox.(c1.loss, ref1.loss; rtol = 2e-5, atol = 0))
        rows = shards[end][1]
        sc = copy(ss[end])
        @test FusedCE.kd_bwd(sc, i32, lpk, c1.row_stats; vocab_start = starts[end], vocab_total = Vk, kw...,
                             dstudent = sc) === sc
        @test all(isapprox.(sc[1:length(rows), :], ref1.dstudent[rows, :]; rtol = 1e-4, atol = 1e-6))
        # a top-K teacher's records carry no divergence: KL's loss from kd_combine is NaN (JSD's is refused)
        if mixture(kw)
            @test kd_status(() -> FusedCE.kd_combine(stacked; vocab_total = Vk, kw...), :fce_kd_combine) ==
                  "INVALID_ARGUMENT"
        else
            @test isnan(FusedCE.kd_combine(stacked; vocab_total = Vk, kw..., reduction = :sum).loss)
        end
    end
    # an id past vocab_total (1-based Vk + 2: in the padding of a padded last shard) makes its column's loss and
    # gradient NaN on every shard, as kd_loss_topk does; the other columns are as with the valid ids
    ido = copy(idk)
    ido[3, 7] = Vk + 2
    @testset "top-K teacher, an id past vocab_total, $name, $(values(kw))" for (name, shards) in layouts,
                                                                               kw in topk_kws[[1, 3, 6]]
        starts = [first(rows) - 1 for (rows, _) in shards]
        ss = [pad(Sk, rows, p) for (rows, p) in shards]
        stacked = cat((FusedCE.kd_partial(ss[r], ido, lpk; vocab_start = starts[r], vocab_total = Vk, kw...)
                       for r in eachindex(shards))...; dims = 3)
        c = kd_vp_combine(stacked, ss, (ido, lpk), starts; targets = tk, kw...)
        ref = FusedCE.kd_loss_topk(Sk, ido, lpk; targets = tk, dstudent = true, kw...)
        good = FusedCE.kd_loss_topk(Sk, idk, lpk; targets = tk, dstudent = true, kw...)
        if kw.reduction === :none
            @test isnan(c.loss[7]) && isnan(ref.loss[7])
            @test all(isapprox.(c.loss[1:6], good.loss[1:6]; rtol = 2e-5, atol = 0))
        else
            @test isnan(c.loss) && isnan(ref.loss)
        end
        @test all(isnan, ref.dstudent[:, 7])
        for (r, (rows, p)) in enumerate(shards)
            d = FusedCE.kd_bwd(ss[r], ido, lpk, c.row_stats; vocab_start = starts[r], vocab_total = Vk, targets = tk,
                               kw..., dstudent = fill(NaN32, size(ss[r])))
            @test all(isnan, d[1:length(rows), 7])
            @test all(d[length(rows)+1:end, :] .== 0)
            @test all(isapprox.(d[1:length(rows), 1:6], good.dstudent[rows, 1:6]; rtol = 1e-4, atol = 1e-6))
        end
    end

    # Float16 student, Float32 teacher: dstudent in Float16; a padded shard given as a view
    s16 = Float16.(Sk)
    ref16 = FusedCE.kd_loss(s16, Tk; targets = tk, dstudent = true, reduction = :none)
    big = vcat(s16[21:53, :], fill(Float16(NaN), 3, Nk), zeros(Float16, 2, Nk))
    tbig = vcat(Tk[21:53, :], fill(NaN32, 3, Nk))
    v16 = view(big, 1:36, :)
    rec16 = cat(FusedCE.kd_partial(s16[1:20, :], Tk[1:20, :]; vocab_start = 0, vocab_total = Vk),
                FusedCE.kd_partial(v16, tbig; vocab_start = 20, vocab_total = Vk); dims = 3)
    c16 = FusedCE.kd_combine(rec16; vocab_total = Vk, targets = tk, reduction = :none)
    @test all(isapprox.(c16.loss, ref16.loss; rtol = 2e-5, atol = 0))
    d16 = FusedCE.kd_bwd(v16, tbig, c16.row_stats; vocab_start = 20, vocab_total = Vk, targets = tk, reduction = :none)
    @test eltype(d16) == Float16 && size(d16) == (36, Nk)
    @test approx(d16[1:33, :], ref16.dstudent[21:53, :]; rtol = 2e-3, atol = 1e-5)
    @test all(d16[34:36, :] .== 0)

    # errors
    s1, s2 = Sk[1:20, :], Sk[21:53, :]
    t1, t2 = Tk[1:20, :], Tk[21:53, :]
    recs = cat(FusedCE.kd_partial(s1, t1; vocab_start = 0, vocab_total = Vk),
               FusedCE.kd_partial(s2, t2; vocab_start = 20, vocab_total = Vk); dims = 3)
    st = FusedCE.kd_combine(recs; vocab_total = Vk).row_stats
    # JSD's record is forward KL's (P the teacher); at beta 0 or 1 JSD is exactly forward or reverse KL (the
    # same records, a loss in the first combine)
    @test FusedCE.kd_partial(s2, t2; vocab_start = 20, vocab_total = Vk, divergence = :jsd, beta = 0.3) ==
          recs[:, :, 2]
    @test FusedCE.kd_combine(recs; vocab_total = Vk, divergence = :jsd, beta = 0).loss ==
          FusedCE.kd_combine(recs; vocab_total = Vk).loss
    @test FusedCE.kd_partial(s2, t2; vocab_start = 20, vocab_total = Vk, divergence = :jsd, beta = 0) ==
          recs[:, :, 2]
    @test FusedCE.kd_partial(s2, t2; vocab_start = 20, vocab_total = Vk, divergence = :jsd, beta = 1) ==
          FusedCE.kd_partial(s2, t2; vocab_start = 20, vocab_total = Vk, divergence = :reverse_kl)
    @test recs[:, :, 2] != FusedCE.kd_partial(s2, t2; vocab_start = 20, vocab_total = Vk, divergence = :reverse_kl)
    # JSD's first combine gives the statistics only: a loss, or no row_stats, is refused (nothing written)
    jkw = (divergence = :jsd, beta = 0.3)
    poison = fill(7.0f0, KS, Nk)
    @test kd_status(() -> FusedCE.kd_combine(recs; vocab_total = Vk, jkw..., row_stats = poison),
                    :fce_kd_combine) == "INVALID_ARGUMENT"
    @test all(==(7.0f0), poison)
    @test kd_status(() -> FusedCE.kd_combine(recs; vocab_total = Vk, jkw..., loss = false, row_stats = false),
                    :fce_kd_combine) == "INVALID_ARGUMENT"
    cj = FusedCE.kd_combine(recs; vocab_total = Vk, jkw..., loss = false)
    trj = cat(FusedCE.kd_terms_partial(s1, t1, cj.row_stats; vocab_start = 0, vocab_total = Vk, jkw...),
              FusedCE.kd_terms_partial(s2, t2, cj.row_stats; vocab_start = 20, vocab_total = Vk, jkw...); dims = 3)
    # the terms' combine: row_stats required; nothing written on failure (A stays NaN)
    @test kd_status(() -> FusedCE.kd_terms_combine(trj, nothing; vocab_total = Vk, jkw...),
                    :fce_kd_terms_combine) == "INVALID_ARGUMENT"
    stj = copy(cj.row_stats)
    @test kd_status(() -> FusedCE.kd_terms_combine(trj, stj; vocab_total = 0, jkw...), :fce_kd_terms_combine) ==
          "INVALID_ARGUMENT"
    @test kd_status(() -> FusedCE.kd_terms_combine(trj, stj; vocab_total = Vk, jkw..., targets = tk[1:end-1]),
                    :fce_kd_terms_combine) == "SHAPE_MISMATCH"
    @test kd_status(() -> FusedCE.kd_terms_combine(trj[1:KT-1, :, :], stj; vocab_total = Vk, jkw...),
                    :fce_kd_terms_combine) == "SHAPE_MISMATCH"
    @test kd_status(() -> FusedCE.kd_terms_combine(recs, stj; vocab_total = Vk, jkw...),   # step 1's records
                    :fce_kd_terms_combine) == "SHAPE_MISMATCH"
    @test kd_status(() -> FusedCE.kd_terms_combine(trj, stj[1:KS-1, :]; vocab_total = Vk, jkw...),
                    :fce_kd_terms_combine) == "SHAPE_MISMATCH"
    tpad = zeros(Float32, KT + 1, Nk, 2)
    tpad[1:KT, :, :] .= trj
    @test kd_status(() -> FusedCE.kd_terms_combine(view(tpad, 1:KT, :, :), stj; vocab_total = Vk, jkw...),
                    :fce_kd_terms_combine) == "UNSUPPORTED_LAYOUT"
    @test isequal(stj, cj.row_stats) && all(isnan, stj[5, :])
    @test FusedCE.kd_terms_combine(trj, stj; vocab_total = Vk, jkw...).loss ≈
          FusedCE.kd_loss(Sk, Tk; jkw...).loss rtol = 2e-5
    @test all(isfinite, stj)
    # the terms' partial: validation, nothing written
    tpoison = fill(7.0f0, KT, Nk)
    tpart(; kw...) = FusedCE.kd_terms_partial(s1, t1, cj.row_stats; vocab_start = 0, vocab_total = Vk, jkw...,
                                              records = tpoison, kw...)
    @test kd_status(() -> tpart(vocab_total = 0), :fce_kd_terms_partial) == "INVALID_ARGUMENT"
    @test kd_status(() -> tpart(vocab_start = Vk + 1), :fce_kd_terms_partial) == "INVALID_ARGUMENT"
    @test kd_status(() -> tpart(temperature = 0), :fce_kd_terms_partial) == "INVALID_ARGUMENT"
    @test kd_status(() -> FusedCE.kd_terms_partial(s1, t2, cj.row_stats; vocab_start = 0, vocab_total = Vk, jkw...,
                                                   records = tpoison), :fce_kd_terms_partial) == "SHAPE_MISMATCH"
    @test kd_status(() -> FusedCE.kd_terms_partial(s1, t1, cj.row_stats[1:KS-1, :]; vocab_start = 0,
                                                   vocab_total = Vk, jkw..., records = tpoison),
                    :fce_kd_terms_partial) == "SHAPE_MISMATCH"
    @test kd_status(() -> FusedCE.kd_terms_partial(s1, t1, cj.row_stats[:, 1:end-1]; vocab_start = 0,
                                                   vocab_total = Vk, jkw..., records = tpoison),
                    :fce_kd_terms_partial) == "SHAPE_MISMATCH"
    @test all(==(7.0f0), tpoison)
    @test kd_status(() -> tpart(records = zeros(Float32, KT + 1, Nk)), :fce_kd_terms_partial) == "SHAPE_MISMATCH"
    @test kd_status(() -> tpart(records = zeros(Float16, KT, Nk)), :fce_kd_terms_partial) == "UNSUPPORTED_DTYPE"
    @test_throws UndefKeywordError FusedCE.kd_terms_partial(s1, t1, cj.row_stats; vocab_total = Vk)
    @test_throws UndefKeywordError FusedCE.kd_terms_combine(trj, stj)
    # raw calls: 0-based top-K ids give what the Julia methods give from the 1-based ones; a teacher with both
    # logits and top-K is refused, nothing written; the terms' combine's workspace query, and a caller's
    # workspace of that size
    h = FusedCE.default_handle()
    ids0 = idk .- 1                                # unused slots 0 and -3 become -1 and -4: still unused
    rpoison, lw, stw = fill(7.0f0, KR, Nk), fill(NaN32, Nk), copy(cj.row_stats)
    rr, tr = fill(NaN32, KR, Nk), fill(NaN32, KT, Nk)
    ts1, tt1, tid, tlp, trs, trp, ttp, trr, ttr, ttrj, tlw, tstw =
        FusedCE.Tensor(s1), FusedCE.Tensor(t1), FusedCE.Tensor(ids0), FusedCE.Tensor(lpk),
        FusedCE.Tensor(cj.row_stats), FusedCE.Tensor(rpoison), FusedCE.Tensor(tpoison), FusedCE.Tensor(rr),
        FusedCE.Tensor(tr), FusedCE.Tensor(trj), FusedCE.Tensor(lw), FusedCE.Tensor(stw)
    GC.@preserve ts1 tt1 tid tlp trs trp ttp trr ttr ttrj tlw tstw begin
        topk = FusedCE._cstruct(L.fce_kd_teacher_t; topk_ids = FusedCE._ptr(tid), topk_logprobs = FusedCE._ptr(tlp))
        both = FusedCE._cstruct(L.fce_kd_teacher_t; logits = FusedCE._ptr(tt1), topk_ids = FusedCE._ptr(tid),
                                topk_logprobs = FusedCE._ptr(tlp))
        for div in (:forward_kl, :jsd)
            opts = FusedCE._kd_options(div, 0.3, 1, false, :renormalize, :none, -100; vocab_start = 0,
                                       vocab_total = Vk)
            @test L.fce_kd_partial(h.ptr, C_NULL, FusedCE._ptr(ts1), both, opts, FusedCE._ptr(trp)) ==
                  L.FCE_STATUS_INVALID_ARGUMENT
            @test L.fce_kd_terms_partial(h.ptr, C_NULL, FusedCE._ptr(ts1), both, FusedCE._ptr(trs), opts,
                                         FusedCE._ptr(ttp)) == L.FCE_STATUS_INVALID_ARGUMENT
            @test L.fce_kd_partial(h.ptr, C_NULL, FusedCE._ptr(ts1), topk, opts, FusedCE._ptr(trr)) ==
                  L.FCE_STATUS_SUCCESS
            @test L.fce_kd_terms_partial(h.ptr, C_NULL, FusedCE._ptr(ts1), topk, FusedCE._ptr(trs), opts,
                                         FusedCE._ptr(ttr)) == L.FCE_STATUS_SUCCESS
            jl = (vocab_start = 0, vocab_total = Vk, divergence = div, beta = 0.3, topk_norm = :renormalize)
            @test isequal(rr, FusedCE.kd_partial(s1, idk, lpk; jl...))
            @test isequal(tr, FusedCE.kd_terms_partial(s1, idk, lpk, cj.row_stats; jl...))
            @test tr[3, :] == [count(in(1:20), idk[:, n]) for n in 1:Nk]
        end
        opts = FusedCE._kd_options(:jsd, 0.3, 1, false, :full_vocab, :none, -100; vocab_start = 0, vocab_total = Vk)
        bytes = Ref{Csize_t}(typemax(Csize_t))
        @test L.fce_kd_terms_combine_workspace_size(h.ptr, FusedCE._ptr(ttrj), C_NULL, opts, FusedCE._ptr(tlw),
                                                    FusedCE._ptr(tstw), bytes) == L.FCE_STATUS_SUCCESS
        @test bytes[] != typemax(Csize_t)
        nobytes = Ref{Csize_t}(7)
        @test L.fce_kd_terms_combine_workspace_size(h.ptr, FusedCE._ptr(ttrj), C_NULL, opts, FusedCE._ptr(tlw),
                                                    C_NULL, nobytes) == L.FCE_STATUS_INVALID_ARGUMENT
        @test nobytes[] == 7
        ws = Vector{UInt8}(undef, max(bytes[], 1))
        GC.@preserve ws begin
            @test L.fce_kd_terms_combine(h.ptr, C_NULL, FusedCE._ptr(ttrj), C_NULL, opts, FusedCE._ptr(tlw),
                                         FusedCE._ptr(tstw), pointer(ws), bytes[]) == L.FCE_STATUS_SUCCESS
        end
    end
    @test all(==(7.0f0), rpoison) && all(==(7.0f0), tpoison)
    @test lw == FusedCE.kd_terms_combine(trj, copy(cj.row_stats); vocab_total = Vk, jkw..., reduction = :none).loss
    @test stw == stj
    # a top-K teacher: its arrays' sizes and element types, its options
    @test kd_status(() -> FusedCE.kd_partial(s1, idk, lpk[:, 1:end-1]; vocab_start = 0, vocab_total = Vk),
                    :fce_kd_partial) == "SHAPE_MISMATCH"
    @test kd_status(() -> FusedCE.kd_partial(s1, idk[:, 1:end-1], lpk[:, 1:end-1]; vocab_start = 0, vocab_total = Vk),
                    :fce_kd_partial) == "SHAPE_MISMATCH"
    @test kd_status(() -> FusedCE.kd_partial(s1, idk, Float16.(lpk); vocab_start = 0, vocab_total = Vk),
                    :fce_kd_partial) == "UNSUPPORTED_DTYPE"
    @test kd_status(() -> FusedCE.kd_terms_partial(s1, idk, lpk[1:end-1, :], st; vocab_start = 0, vocab_total = Vk),
                    :fce_kd_terms_partial) == "SHAPE_MISMATCH"
    @test kd_status(() -> FusedCE.kd_bwd(s1, idk, Float16.(lpk), st; vocab_start = 0, vocab_total = Vk),
                    :fce_kd_bwd) == "UNSUPPORTED_DTYPE"
    @test kd_status(() -> FusedCE.kd_bwd(s1, idk, lpk, st; vocab_start = 0, vocab_total = Vk, temperature = 0),
                    :fce_kd_bwd) == "INVALID_ARGUMENT"
    @test_throws ArgumentError FusedCE.kd_partial(s1, idk, lpk; vocab_start = 0, vocab_total = Vk, topk_norm = :full)
    @test_throws UndefKeywordError FusedCE.kd_bwd(s1, idk, lpk, st; vocab_total = Vk)
    @test_throws MethodError FusedCE.kd_partial(s1, Float32.(idk), lpk; vocab_start = 0, vocab_total = Vk)
    # no shard in the options, or a vocab_start outside [0, vocab_total] (vocab_total: a shard of padding alone)
    @test kd_status(() -> FusedCE.kd_partial(s1, t1; vocab_start = 0, vocab_total = 0), :fce_kd_partial) ==
          "INVALID_ARGUMENT"
    @test kd_status(() -> FusedCE.kd_combine(recs; vocab_total = 0), :fce_kd_combine) == "INVALID_ARGUMENT"
    @test kd_status(() -> FusedCE.kd_bwd(s1, t1, st; vocab_start = 0, vocab_total = 0), :fce_kd_bwd) ==
          "INVALID_ARGUMENT"
    @test kd_status(() -> FusedCE.kd_partial(s2, t2; vocab_start = Vk + 1, vocab_total = Vk), :fce_kd_partial) ==
          "INVALID_ARGUMENT"
    @test kd_status(() -> FusedCE.kd_partial(s2, t2; vocab_start = Vk, vocab_total = Vk), :fce_kd_partial) ==
          "no error"
    @test kd_status(() -> FusedCE.kd_partial(s2, t2; vocab_start = -1, vocab_total = Vk), :fce_kd_partial) ==
          "INVALID_ARGUMENT"
    @test kd_status(() -> FusedCE.kd_partial(s2, t2; vocab_start = 20, vocab_total = Vk, temperature = 0),
                    :fce_kd_partial) == "INVALID_ARGUMENT"
    # kd_loss takes whole rows only
    @test kd_status(() -> FusedCE.kd_loss(Sk, Tk; vocab_start = 0, vocab_total = Vk), :fce_kd_loss) ==
          "INVALID_ARGUMENT"
    # shapes, layout, dtype
    @test kd_status(() -> FusedCE.kd_partial(s2, t1; vocab_start = 20, vocab_total = Vk), :fce_kd_partial) ==
          "SHAPE_MISMATCH"
    @test kd_status(() -> FusedCE.kd_partial(s2, t2; vocab_start = 20, vocab_total = Vk,
                                             records = zeros(Float32, KR - 1, Nk)), :fce_kd_partial) == "SHAPE_MISMATCH"
    @test kd_status(() -> FusedCE.kd_combine(recs[1:KR-1, :, :]; vocab_total = Vk), :fce_kd_combine) == "SHAPE_MISMATCH"
    @test kd_status(() -> FusedCE.kd_combine(recs; vocab_total = Vk, targets = tk[1:end-1]), :fce_kd_combine) ==
          "SHAPE_MISMATCH"
    padded = zeros(Float32, KR + 1, Nk, 2)
    padded[1:KR, :, :] .= recs
    @test kd_status(() -> FusedCE.kd_combine(view(padded, 1:KR, :, :); vocab_total = Vk), :fce_kd_combine) ==
          "UNSUPPORTED_LAYOUT"
    @test kd_status(() -> FusedCE.kd_bwd(s1, t1, st[1:KS-1, :]; vocab_start = 0, vocab_total = Vk), :fce_kd_bwd) ==
          "SHAPE_MISMATCH"
    @test kd_status(() -> FusedCE.kd_bwd(s1, t1, st; vocab_start = 0, vocab_total = Vk,
                                         dstudent = zeros(Float16, 20, Nk)), :fce_kd_bwd) == "UNSUPPORTED_DTYPE"
    @test_throws UndefKeywordError FusedCE.kd_partial(s1, t1; vocab_total = Vk)
    @test_throws UndefKeywordError FusedCE.kd_combine(recs)
    @test_throws UndefKeywordError FusedCE.kd_bwd(s1, t1, st; vocab_total = Vk)
    @test_throws ArgumentError FusedCE.kd_partial(s1, t1; vocab_start = 0, vocab_total = Vk, divergence = :kl)
end

@testset "linear cross-entropy $(keys(kw)) $(values(kw))" for kw in (
        (;),
        (reduction = :sum, label_smoothing = 0.1),
        (reduction = :none, z_loss_scale = 1e-2, softcap = 4.0))
    H = 5
    hid = randn(Float32, H, N)
    W = randn(Float32, H, V) .* 0.5f0
    b = randn(Float32, V) .* 0.1f0
    lt = rand(1:V, N); lt[2] = -100
    logits(h, w, bb) = w' * h .+ bb
    ref = ce_ref(logits(Float64.(hid), Float64.(W), Float64.(b)), lt; kw...)
    r = FusedCE.linear_cross_entropy_fwd(hid, W, lt; bias = b, kw..., argmax = true, z_loss = true,
                                         entropy = true, dhidden = true, dweight = true, dbias = true)
    @test approx(r.loss, ref.loss; rtol = 1e-4, atol = 1e-4)
    @test approx(r.lse, ref.lse; rtol = 1e-4, atol = 1e-4)
    @test approx(r.z_loss, ref.z_loss; rtol = 1e-4, atol = 1e-4)
    @test approx(r.entropy, ref.entropy; rtol = 1e-4, atol = 1e-4)
    @test r.argmax == ref.argmax
    f(h, w, bb) = ce_ref(logits(h, w, bb), lt; kw...).loss
    Gh = fd_grad(x -> f(x, Float64.(W), Float64.(b)), Float64.(hid))
    Gw = fd_grad(x -> f(Float64.(hid), x, Float64.(b)), Float64.(W))
    Gb = fd_grad(x -> f(Float64.(hid), Float64.(W), x), Float64.(b))
    @test approx(r.dhidden, Gh; atol = 1e-4, rtol = 1e-4)
    @test approx(r.dweight, Gw; atol = 1e-4, rtol = 1e-4)
    @test approx(r.dbias, Gb; atol = 1e-4, rtol = 1e-4)
    @test FusedCE.linear_cross_entropy(hid, W, lt; bias = b, kw...) == r.loss
    # backward from the saved lse, with an upstream gradient
    g = get(kw, :reduction, :mean) === :none ? rand(Float32, N) : 0.5f0
    d = FusedCE.linear_cross_entropy_bwd(hid, W, lt, r.lse; bias = b, kw..., grad_loss = g)
    @test approx(d.dhidden, fd_grad(x -> f(x, Float64.(W), Float64.(b)), Float64.(hid); g = Float64.(g)); atol = 1e-4, rtol = 1e-4)
    @test approx(d.dweight, fd_grad(x -> f(Float64.(hid), x, Float64.(b)), Float64.(W); g = Float64.(g)); atol = 1e-4, rtol = 1e-4)
    @test approx(d.dbias, fd_grad(x -> f(Float64.(hid), Float64.(W), x), Float64.(b); g = Float64.(g)); atol = 1e-4, rtol = 1e-4)
    # without a bias
    r0 = FusedCE.linear_cross_entropy_fwd(hid, W, lt; kw...)
    @test approx(r0.loss, ce_ref(logits(Float64.(hid), Float64.(W), 0.0), lt; kw...).loss; rtol = 1e-4, atol = 1e-4)
end

@testset "linear cross-entropy entropy gradient $(keys(kw))" for kw in (
        (;), (softcap = 4.0, logit_scale = 0.8, label_smoothing = 0.1, z_loss_scale = 1e-2))
    H, Vl, Nl = 6, 37, 5
    hid = randn(Float32, H, Nl)
    W = randn(Float32, H, Vl)
    b = randn(Float32, Vl) .* 0.1f0
    lt = rand(1:Vl, Nl); lt[2] = -100
    gl = rand(Float32, Nl) .* 2 .- 0.5f0
    ge = randn(Float32, Nl)
    Z = Float64.(W)' * Float64.(hid) .+ Float64.(b)
    G = ce_entropy_grad_ref(Z, lt, gl, ge; kw...)           # d/dlogits, V×N
    G0 = ce_entropy_grad_ref(Z, lt, gl, zeros(Nl); kw...)
    dh_ref, dw_ref, db_ref = Float64.(W) * G, Float64.(hid) * G', vec(sum(G; dims = 2))
    @test maximum(abs.(Float64.(W) * G0 .- dh_ref)) > 1e-2 * maximum(abs, dh_ref)   # the entropy's term matters
    dh, dw, db, E = fill(NaN32, H, Nl), fill(NaN32, H, Vl), fill(NaN32, Vl), fill(NaN32, Nl)
    r = FusedCE.linear_cross_entropy_fwd(hid, W, lt; bias = b, reduction = :none, kw..., entropy = E, dhidden = dh,
                                         dweight = dw, dbias = db, grad_loss = gl, grad_entropy = ge)
    @test r.dhidden === dh && r.dweight === dw && r.dbias === db && r.entropy === E
    @test close_to_max(dh, dh_ref; rtol = 2e-5)
    @test close_to_max(dw, dw_ref; rtol = 2e-5)
    @test close_to_max(db, db_ref; rtol = 2e-5)
    # the backward from the saved lse and entropy
    bh, bw, bb = fill(NaN32, H, Nl), fill(NaN32, H, Vl), fill(NaN32, Vl)
    d = FusedCE.linear_cross_entropy_bwd(hid, W, lt, r.lse; bias = b, reduction = :none, kw..., dhidden = bh,
                                         dweight = bw, dbias = bb, grad_loss = gl, grad_entropy = ge,
                                         saved_entropy = E)
    @test d.dhidden === bh && d.dweight === bw && d.dbias === bb
    @test close_to_max(bh, dh_ref; rtol = 2e-5)
    @test close_to_max(bw, dw_ref; rtol = 2e-5)
    @test close_to_max(bb, db_ref; rtol = 2e-5)
    # a scalar grad_entropy, dhidden alone
    rs = FusedCE.linear_cross_entropy_fwd(hid, W, lt; bias = b, reduction = :none, kw..., dhidden = fill(NaN32, H, Nl),
                                          grad_loss = gl, grad_entropy = -0.5)
    @test close_to_max(rs.dhidden, Float64.(W) * ce_entropy_grad_ref(Z, lt, gl, fill(-0.5, Nl); kw...); rtol = 2e-5)
    # errors: grad_entropy without a gradient output, or in the backward without saved_entropy
    @test fce_status_name(() -> FusedCE.linear_cross_entropy_fwd(hid, W, lt; bias = b, reduction = :none, kw...,
                                                                 grad_entropy = ge)) == "INVALID_ARGUMENT"
    @test fce_status_name(() -> FusedCE.linear_cross_entropy_bwd(hid, W, lt, r.lse; bias = b, reduction = :none, kw...,
                                                                 grad_entropy = ge)) == "INVALID_ARGUMENT"
    @test fce_status_name(() -> FusedCE.linear_cross_entropy_bwd(hid, W, lt, r.lse; bias = b, reduction = :none, kw...,
                                                                 grad_entropy = ge, saved_entropy = E[1:end-1])) ==
          "SHAPE_MISMATCH"
end

# max |a - (start + g)| within rtol of the gradient g, plus the rounding of the sums to Float32 (one per call)
accumulated(a, start, g; rtol = 2e-5, calls = 1) =
    maximum(abs.(Float64.(a) .- (Float64.(start) .+ g))) <=
    rtol * maximum(abs, g) + calls * eps(Float32) * maximum(abs.(Float64.(start) .+ g))

@testset "linear cross-entropy: accumulate (FCE_LINEAR_CE_ACCUMULATE)" begin
    H, Vl, Nl = 6, 29, 7
    hid = randn(Float32, H, Nl)
    W = randn(Float32, H, Vl) .* 0.5f0
    b = randn(Float32, Vl) .* 0.1f0
    lt = rand(1:Vl, Nl); lt[4] = -100
    used = count(!=(-100), lt)
    # Float64 reference: d(mean loss)/dlogits (V×N), then through the linear layer
    Z = Float64.(W)' * Float64.(hid) .+ Float64.(b)
    G = ce_entropy_grad_ref(Z, lt, fill(1 / used, Nl), zeros(Nl))
    dh_ref, dw_ref, db_ref = Float64.(W) * G, Float64.(hid) * G', vec(sum(G; dims = 2))
    # known starting values, of the gradients' size and magnitude (not 0: an overwrite must show)
    known(dims...) = reshape(Float32.(range(-0.5, 0.75; length = prod(dims))), dims...)
    dh0, dw0, db0 = known(H, Nl), known(H, Vl), known(Vl)
    @test minimum(abs.(dh0)) > 0 && minimum(abs.(dw0)) > 0 && minimum(abs.(db0)) > 0

    # two accumulating forward calls (two micro-batches): start + 2 × the gradient
    dh, dw, db = copy(dh0), copy(dw0), copy(db0)
    for _ in 1:2
        r = FusedCE.linear_cross_entropy_fwd(hid, W, lt; bias = b, dhidden = dh, dweight = dw, dbias = db,
                                             accumulate = true)
        @test r.dhidden === dh && r.dweight === dw && r.dbias === db
        @test approx(r.loss, ce_ref(Z, lt).loss; rtol = 1e-4, atol = 1e-4)
    end
    @test accumulated(dh, dh0, 2 .* dh_ref; calls = 2)
    @test accumulated(dw, dw0, 2 .* dw_ref; calls = 2)
    @test accumulated(db, db0, 2 .* db_ref; calls = 2)
    @test all(dh[:, 4] .== dh0[:, 4])                       # the ignored row adds 0
    # one of the three only, the others not asked for
    dw1 = copy(dw0)
    r1 = FusedCE.linear_cross_entropy_fwd(hid, W, lt; bias = b, dweight = dw1, accumulate = true)
    @test r1.dweight === dw1 && r1.dhidden === nothing && r1.dbias === nothing
    @test accumulated(dw1, dw0, dw_ref)

    # without accumulate the same arrays are overwritten
    dh, dw, db = copy(dh0), copy(dw0), copy(db0)
    FusedCE.linear_cross_entropy_fwd(hid, W, lt; bias = b, dhidden = dh, dweight = dw, dbias = db)
    @test close_to_max(dh, dh_ref; rtol = 2e-5)
    @test close_to_max(dw, dw_ref; rtol = 2e-5)
    @test close_to_max(db, db_ref; rtol = 2e-5)

    # the backward from the saved lse, with an upstream gradient: start + g × the gradient
    lse = FusedCE.linear_cross_entropy_fwd(hid, W, lt; bias = b).lse
    g = 0.75f0
    dh, dw, db = copy(dh0), copy(dw0), copy(db0)
    d = FusedCE.linear_cross_entropy_bwd(hid, W, lt, lse; bias = b, dhidden = dh, dweight = dw, dbias = db,
                                         grad_loss = g, accumulate = true)
    @test d.dhidden === dh && d.dweight === dw && d.dbias === db
    @test accumulated(dh, dh0, g .* dh_ref)
    @test accumulated(dw, dw0, g .* dw_ref)
    @test accumulated(db, db0, g .* db_ref)
    # a second backward adds again
    FusedCE.linear_cross_entropy_bwd(hid, W, lt, lse; bias = b, dhidden = dh, dweight = dw, dbias = db,
                                     grad_loss = g, accumulate = true)
    @test accumulated(dw, dw0, 2g .* dw_ref; calls = 2)
    # ... and without accumulate overwrites
    dh, dw, db = copy(dh0), copy(dw0), copy(db0)
    FusedCE.linear_cross_entropy_bwd(hid, W, lt, lse; bias = b, dhidden = dh, dweight = dw, dbias = db, grad_loss = g)
    @test close_to_max(dh, g .* dh_ref; rtol = 2e-5)
    @test close_to_max(dw, g .* dw_ref; rtol = 2e-5)
    @test close_to_max(db, g .* db_ref; rtol = 2e-5)

    # a shard's backward (columns 16:29 of the LM head, padded by 2): the Float32 dhidden part, dweight and
    # dbias added into; the padding columns/entries left as they are (written 0 without accumulate)
    lo, pad = 16, 2
    Ws = hcat(W[:, lo:Vl], fill(NaN32, H, pad))
    bs = vcat(b[lo:Vl], fill(NaN32, pad))
    n = Vl - lo + 1
    Gs = G[lo:Vl, :]
    sdw0, sdb0 = known(H, n + pad), known(n + pad)
    sdh, sdw, sdb = copy(dh0), copy(sdw0), copy(sdb0)
    FusedCE.linear_cross_entropy_bwd(hid, Ws, lt, lse; bias = bs, vocab_start = lo - 1, vocab_total = Vl,
                                     dhidden = sdh, dweight = sdw, dbias = sdb, accumulate = true)
    @test accumulated(sdh, dh0, Float64.(W[:, lo:Vl]) * Gs)
    @test accumulated(sdw[:, 1:n], sdw0[:, 1:n], Float64.(hid) * Gs')
    @test accumulated(sdb[1:n], sdb0[1:n], vec(sum(Gs; dims = 2)))
    @test sdw[:, n+1:end] == sdw0[:, n+1:end] && sdb[n+1:end] == sdb0[n+1:end]
    FusedCE.linear_cross_entropy_bwd(hid, Ws, lt, lse; bias = bs, vocab_start = lo - 1, vocab_total = Vl,
                                     dhidden = sdh, dweight = sdw, dbias = sdb)
    @test all(sdw[:, n+1:end] .== 0) && all(sdb[n+1:end] .== 0)
    @test close_to_max(sdw[:, 1:n], Float64.(hid) * Gs'; rtol = 2e-5)

    # Float16 inputs into a Float32 dweight (a main_grad): start + the Float32 gradient, rounded once
    h16, W16 = Float16.(hid), Float16.(W)
    plain = FusedCE.linear_cross_entropy_fwd(h16, W16, lt; dweight = zeros(Float32, H, Vl)).dweight
    dw32 = copy(dw0)
    FusedCE.linear_cross_entropy_fwd(h16, W16, lt; dweight = dw32, accumulate = true)
    @test maximum(abs.(Float64.(dw32) .- (Float64.(dw0) .+ Float64.(plain)))) <=
          eps(Float32) * maximum(abs.(Float64.(dw0) .+ Float64.(plain)))

    # errors: `true` (an uninitialized array) with accumulate, the backward's defaults included; the library's
    # shape check of a given array
    @test_throws ArgumentError FusedCE.linear_cross_entropy_fwd(hid, W, lt; bias = b, dweight = true, accumulate = true)
    @test_throws ArgumentError FusedCE.linear_cross_entropy_bwd(hid, W, lt, lse; bias = b, dweight = copy(dw0),
                                                                accumulate = true)
    @test_throws ArgumentError FusedCE.linear_cross_entropy_bwd(hid, W, lt, lse; bias = b, dhidden = false,
                                                                dweight = copy(dw0), accumulate = true)
    d2 = FusedCE.linear_cross_entropy_bwd(hid, W, lt, lse; bias = b, dhidden = false, dweight = copy(dw0),
                                          dbias = false, accumulate = true)
    @test d2.dhidden === nothing && d2.dbias === nothing && accumulated(d2.dweight, dw0, dw_ref)
    @test fce_status_name(() -> FusedCE.linear_cross_entropy_fwd(hid, W, lt; bias = b, dweight = zeros(Float32, H, Vl - 1),
                                                                 accumulate = true)) == "SHAPE_MISMATCH"
    @test fce_status_name(() -> FusedCE.linear_cross_entropy_bwd(hid, W, lt, lse; bias = b, dhidden = false,
                                                                 dweight = false, dbias = false,
                                                                 accumulate = true)) == "INVALID_ARGUMENT"
end

@testset "vocabulary-parallel linear cross-entropy $(length(cuts) + 1) shards $(keys(kw))" for
        cuts in ((15,), (10, 28)),                 # uneven shards of V = 41: 1:15, 16:41 / 1:10, 11:28, 29:41
        kw in ((;), (reduction = :none, label_smoothing = 0.1, z_loss_scale = 1e-3),
               (reduction = :sum, softcap = 4.0, logit_scale = 0.8))
    Nv, Hv, Vv = 7, 12, 41
    K = FusedCE.cross_entropy_record_fields()
    hid = randn(Float32, Hv, Nv)
    W = randn(Float32, Hv, Vv) .* 0.5f0           # H×V: the C [V, H]
    b = randn(Float32, Vv) .* 0.1f0
    lt = rand(1:Vv, Nv); lt[3] = -100              # an ignored row
    lt[5] = Vv                                     # the last class, in the padded shard
    g = get(kw, :reduction, :mean) === :none ? rand(Float32, Nv) : 0.5f0
    ref = FusedCE.linear_cross_entropy_fwd(hid, W, lt; bias = b, kw..., z_loss = true, argmax = true, entropy = true,
                                           dhidden = true, dweight = true, dbias = true, grad_loss = g)
    # the shards: columns lo:hi of W (vocab_start = lo - 1), the last padded by `pad` columns of NaN
    los = (1, (c + 1 for c in cuts)...)
    his = (cuts..., Vv)
    pad = 2 + length(cuts)
    Ws = [i == length(los) ? hcat(W[:, los[i]:his[i]], fill(NaN32, Hv, pad)) : W[:, los[i]:his[i]] for i in eachindex(los)]
    bs = [i == length(los) ? vcat(b[los[i]:his[i]], fill(NaN32, pad)) : b[los[i]:his[i]] for i in eachindex(los)]
    starts = [lo - 1 for lo in los]
    recs = [FusedCE.linear_cross_entropy_partial(hid, Ws[i], lt; bias = bs[i], vocab_start = starts[i],
                                                 vocab_total = Vv, kw...) for i in eachindex(los)]
    @test all(r -> size(r) == (K, Nv) && eltype(r) == Float32, recs)
    c = FusedCE.cross_entropy_combine(cat(recs...; dims = 3), lt; vocab_total = Vv, kw..., z_loss = true,
                                      argmax = true, entropy = true)
    @test approx(c.loss, ref.loss; rtol = 1e-4, atol = 1e-5)
    @test approx(c.lse, ref.lse; rtol = 1e-4, atol = 1e-5)
    @test approx(c.z_loss, ref.z_loss; rtol = 1e-4, atol = 1e-5)
    @test approx(c.entropy, ref.entropy; rtol = 1e-4, atol = 1e-5)
    @test c.argmax == ref.argmax
    # the combined lse's pairs, for the shards' backward
    cp = FusedCE.cross_entropy_combine(cat(recs...; dims = 3), lt; vocab_total = Vv, kw..., lse = :pair)
    @test size(cp.lse) == (2, Nv) && approx(lse_from_pairs(cp.lse), c.lse; rtol = 3e-7, atol = 0)
    # each shard's backward from the combined lse's pairs; the Float32 dhidden parts summed
    grads = [FusedCE.linear_cross_entropy_bwd(hid, Ws[i], lt, cp.lse; bias = bs[i], vocab_start = starts[i],
                                              vocab_total = Vv, kw..., grad_loss = g) for i in eachindex(los)]
    @test all(d -> eltype(d.dhidden) == Float32 && size(d.dhidden) == (Hv, Nv), grads)
    dh = sum(d.dhidden for d in grads)
    @test approx(dh, ref.dhidden; rtol = 1e-4, atol = 1e-5)
    @test all(dh[:, 3] .== 0)                      # the ignored row
    for i in eachindex(los)
        n = his[i] - los[i] + 1
        @test size(grads[i].dweight) == size(Ws[i]) && size(grads[i].dbias) == size(bs[i])
        @test approx(grads[i].dweight[:, 1:n], ref.dweight[:, los[i]:his[i]]; rtol = 1e-4, atol = 1e-5)
        @test approx(grads[i].dbias[1:n], ref.dbias[los[i]:his[i]]; rtol = 1e-4, atol = 1e-5)
    end
    @test all(grads[end].dweight[:, end-pad+1:end] .== 0)    # padding: never read, gradient 0
    @test all(grads[end].dbias[end-pad+1:end] .== 0)
    # given outputs are written and returned; without a bias
    dhb, dwb = fill(NaN32, Hv, Nv), fill(NaN32, size(Ws[1])...)
    d0 = FusedCE.linear_cross_entropy_bwd(hid, Ws[1], lt, cp.lse; bias = bs[1], vocab_start = starts[1],
                                          vocab_total = Vv, kw..., grad_loss = g, dhidden = dhb, dweight = dwb,
                                          dbias = false)
    @test d0.dhidden === dhb && d0.dweight === dwb && d0.dbias === nothing
    @test dhb == grads[1].dhidden && dwb == grads[1].dweight
    r0 = [FusedCE.linear_cross_entropy_partial(hid, Ws[i], lt; vocab_start = starts[i], vocab_total = Vv, kw...)
          for i in eachindex(los)]
    c0 = FusedCE.linear_cross_entropy_fwd(hid, W, lt; kw...)
    @test approx(FusedCE.cross_entropy_combine(cat(r0...; dims = 3), lt; vocab_total = Vv, kw...).loss, c0.loss;
                 rtol = 1e-4, atol = 1e-5)
    # errors: a Float16 dhidden on a shard; a shard's options in the unsharded forward
    @test fce_status_name(() -> FusedCE.linear_cross_entropy_bwd(hid, Ws[1], lt, c.lse; bias = bs[1],
                                                                 vocab_start = starts[1], vocab_total = Vv, kw...,
                                                                 grad_loss = g, dhidden = zeros(Float16, Hv, Nv))) ==
          "UNSUPPORTED_DTYPE"
    @test fce_status_name(() -> FusedCE.linear_cross_entropy_fwd(hid, W, lt; bias = b, kw..., vocab_start = 0,
                                                                 vocab_total = Vv)) == "INVALID_ARGUMENT"
    @test fce_status_name(() -> FusedCE.linear_cross_entropy(hid, Ws[1], lt; kw..., vocab_start = 0,
                                                             vocab_total = Vv)) == "INVALID_ARGUMENT"
end

@testset "vocabulary-parallel linear cross-entropy: records, workspace, Float16, errors" begin
    Nv, Hv, Vv = 7, 12, 41
    K = FusedCE.cross_entropy_record_fields()
    hid = randn(Float32, Hv, Nv)
    W = randn(Float32, Hv, Vv) .* 0.5f0
    lt = rand(1:Vv, Nv)
    W1, W2 = W[:, 1:20], hcat(W[:, 21:41], fill(NaN32, Hv, 3))
    # the records are cross_entropy_partial's of the shard's logits
    Z2 = vcat(W[:, 21:41]' * hid, fill(NaN32, 3, Nv))
    r2 = FusedCE.linear_cross_entropy_partial(hid, W2, lt; vocab_start = 20, vocab_total = Vv)
    @test approx(r2, FusedCE.cross_entropy_partial(Z2, lt; vocab_start = 20, vocab_total = Vv); rtol = 1e-5, atol = 1e-5)
    # a caller's records buffer (a narrower width too), Int32 targets, a view of a padded weight
    buf = fill(NaN32, K, Nv)
    @test FusedCE.linear_cross_entropy_partial(hid, W2, Int32.(lt); vocab_start = 20, vocab_total = Vv,
                                               records = buf) === buf
    @test buf == r2
    big = hcat(W2, randn(Float32, Hv, 2))
    @test FusedCE.linear_cross_entropy_partial(hid, view(big, :, 1:24), lt; vocab_start = 20, vocab_total = Vv) == r2
    nl = L.FCE_CE_RECORD_FIELDS_LOSS
    rl = FusedCE.linear_cross_entropy_partial(hid, W2, lt; vocab_start = 20, vocab_total = Vv,
                                              records = Matrix{Float32}(undef, nl, Nv))
    @test rl == r2[1:nl, :]
    # the workspace query (the wrappers use the handle's cached workspace, as linear_cross_entropy_fwd),
    # and a caller's workspace of that size giving the same records
    h = FusedCE.default_handle()
    rw = fill(NaN32, K, Nv)
    th, tw, tt, trw = FusedCE.Tensor(hid), FusedCE.Tensor(W2), FusedCE.Tensor(lt .- 1), FusedCE.Tensor(rw)
    GC.@preserve th tw tt trw begin
        opts = FusedCE._ce_options(:mean, -100, 0, 0, 0, 1, nothing; vocab_start = 20, vocab_total = Vv)
        bytes = Ref{Csize_t}(typemax(Csize_t))
        @test L.fce_linear_cross_entropy_partial_workspace_size(h.ptr, FusedCE._ptr(th), FusedCE._ptr(tw), C_NULL,
                                                                FusedCE._ptr(tt), opts, FusedCE._ptr(trw), bytes) ==
              L.FCE_STATUS_SUCCESS
        @test 0 < bytes[] < typemax(Csize_t)
        ws = Vector{UInt8}(undef, bytes[])
        GC.@preserve ws begin
            @test L.fce_linear_cross_entropy_partial(h.ptr, C_NULL, FusedCE._ptr(th), FusedCE._ptr(tw), C_NULL,
                                                     FusedCE._ptr(tt), opts, FusedCE._ptr(trw), pointer(ws),
                                                     length(ws)) == L.FCE_STATUS_SUCCESS
        end
        @test rw == r2
        unsharded = FusedCE._ce_options(:mean, -100, 0, 0, 0, 1, nothing)
        @test L.fce_linear_cross_entropy_partial_workspace_size(h.ptr, FusedCE._ptr(th), FusedCE._ptr(tw), C_NULL,
                                                                FusedCE._ptr(tt), unsharded, FusedCE._ptr(trw),
                                                                bytes) == L.FCE_STATUS_INVALID_ARGUMENT
    end
    # Float16 inputs: dhidden = true allocates the Float32 part; the parts' sum is the unsharded dhidden
    h16, W16 = Float16.(hid), Float16.(W)
    ref16 = FusedCE.linear_cross_entropy_fwd(h16, W16, lt; dhidden = true, dweight = true)
    rs = [FusedCE.linear_cross_entropy_partial(h16, Float16.(W1), lt; vocab_start = 0, vocab_total = Vv),
          FusedCE.linear_cross_entropy_partial(h16, Float16.(W2), lt; vocab_start = 20, vocab_total = Vv)]
    c16 = FusedCE.cross_entropy_combine(cat(rs...; dims = 3), lt; vocab_total = Vv, lse = :pair)
    @test approx(c16.loss, ref16.loss; rtol = 1e-4, atol = 1e-5)
    @test approx(lse_from_pairs(c16.lse), ref16.lse; rtol = 1e-4, atol = 1e-5)
    d1 = FusedCE.linear_cross_entropy_bwd(h16, Float16.(W1), lt, c16.lse; vocab_start = 0, vocab_total = Vv)
    d2 = FusedCE.linear_cross_entropy_bwd(h16, Float16.(W2), lt, c16.lse; vocab_start = 20, vocab_total = Vv)
    @test eltype(d1.dhidden) == Float32 && eltype(d2.dhidden) == Float32
    @test eltype(d1.dweight) == Float16 && d1.dbias === nothing
    @test close_to_max(d1.dhidden .+ d2.dhidden, Float64.(ref16.dhidden); rtol = 2e-3)
    @test close_to_max(hcat(d1.dweight, d2.dweight[:, 1:21]), Float64.(ref16.dweight); rtol = 2e-3)
    @test all(d2.dweight[:, 22:24] .== 0)
    @test fce_status_name(() -> FusedCE.linear_cross_entropy_bwd(h16, Float16.(W1), lt, c16.lse; vocab_start = 0,
                                                                 vocab_total = Vv, dhidden = similar(h16))) ==
          "UNSUPPORTED_DTYPE"
    # errors
    @test fce_status_name(() -> FusedCE.linear_cross_entropy_partial(hid, W1, lt; vocab_start = 0, vocab_total = 0)) ==
          "INVALID_ARGUMENT"
    @test fce_status_name(() -> FusedCE.linear_cross_entropy_partial(hid, W1, lt; vocab_start = Vv + 1,
                                                                     vocab_total = Vv)) == "INVALID_ARGUMENT"
    @test fce_status_name(() -> FusedCE.linear_cross_entropy_partial(hid, W1, lt[1:end-1]; vocab_start = 0,
                                                                     vocab_total = Vv)) == "SHAPE_MISMATCH"
    @test fce_status_name(() -> FusedCE.linear_cross_entropy_partial(hid, Float16.(W1), lt; vocab_start = 0,
                                                                     vocab_total = Vv)) == "UNSUPPORTED_DTYPE"
    @test fce_status_name(() -> FusedCE.linear_cross_entropy_partial(hid, W1, lt; vocab_start = 0, vocab_total = Vv,
                                                                     records = zeros(Float32, K, Nv + 1))) ==
          "SHAPE_MISMATCH"
    @test fce_status_name(() -> FusedCE.linear_cross_entropy_bwd(hid, W1, lt, zeros(Float32, Nv); vocab_start = Vv + 1,
                                                                 vocab_total = Vv)) == "INVALID_ARGUMENT"
    @test_throws UndefKeywordError FusedCE.linear_cross_entropy_partial(hid, W1, lt; vocab_total = Vv)
    @test_throws UndefKeywordError FusedCE.linear_cross_entropy_partial(hid, W1, lt; vocab_start = 0)
end

# Since 0.2.0 every record carries its shard's column range, and every combine checks that the ranges tile
# [0, vocab_total) in rank order: NaN columns otherwise (argmax -1), never a plausible number, no error.
@testset "shard layouts: combines of shards that do not tile the vocabulary give NaN" begin
    Vl, Nl = 60, 4
    Xl = randn(Float32, Vl, Nl) .* 2
    Tl = randn(Float32, Vl, Nl) .* 2
    tl = [5, 30, 59, -100]                       # a target in each third, and an ignored column
    rows(X, st, w) = Float32[st + i <= Vl ? X[st + i, n] : NaN32 for i in 1:w, n in 1:size(X, 2)]
    layouts = ("tiling [0,20) [20,40) [40,60)" => ([0, 20, 40], [20, 20, 20], true),
               "overlapping [0,20) [15,40) [40,60)" => ([0, 15, 40], [20, 25, 20], false),
               "a gap [0,20) [25,40) [40,60)" => ([0, 25, 40], [20, 15, 20], false),
               "out of order [20,40) [0,20) [40,60)" => ([20, 0, 40], [20, 20, 20], false),
               "the last missing [0,20) [20,40)" => ([0, 20], [20, 20], false))
    kdref = FusedCE.kd_loss(Xl, Tl; targets = tl, reduction = :none).loss
    @testset "$name" for (name, (starts, widths, tiles)) in layouts
        W = length(starts)
        shard(r) = rows(Xl, starts[r], widths[r])
        tshard(r) = rows(Tl, starts[r], widths[r])
        # cross-entropy: loss, lse (both forms), z_loss, entropy NaN and argmax -1 in every column
        recs = cat([FusedCE.cross_entropy_partial(shard(r), tl; vocab_start = starts[r], vocab_total = Vl,
                                                  reduction = :none, z_loss_scale = 1e-3) for r in 1:W]...; dims = 3)
        for r in 1:W
            @test all(reinterpret(Int32, recs[5:6, :, r]) .== Int32[starts[r], starts[r] + widths[r]])
        end
        c = FusedCE.cross_entropy_combine(recs, tl; vocab_total = Vl, reduction = :none, z_loss_scale = 1e-3,
                                          z_loss = true, entropy = true, argmax = true)
        cp = FusedCE.cross_entropy_combine(recs, tl; vocab_total = Vl, reduction = :none, z_loss_scale = 1e-3,
                                           lse = :pair)
        cm = FusedCE.cross_entropy_combine(recs, tl; vocab_total = Vl, z_loss_scale = 1e-3)
        if tiles
            @test approx(c.loss, FusedCE.cross_entropy_fwd(Xl, tl; reduction = :none, z_loss_scale = 1e-3).loss)
            @test all(isfinite, c.lse) && all(isfinite, cp.lse) && all(c.argmax .>= 1) && isfinite(cm.loss)
        else
            @test all(isnan, c.loss) && all(isnan, c.lse) && all(isnan, cp.lse)
            @test all(isnan, c.z_loss) && all(isnan, c.entropy) && isnan(cm.loss)
            @test all(c.argmax .== 0)                # -1, made 1-based
        end
        # logsumexp: the lse (both forms)
        lrecs = cat([FusedCE.logsumexp_partial(shard(r); vocab_start = starts[r], vocab_total = Vl, scale = 0.5)
                     for r in 1:W]...; dims = 3)
        @test all(isnan.(FusedCE.logsumexp_combine(lrecs)) .!= tiles)
        @test all(isnan.(FusedCE.logsumexp_combine(lrecs; out = :pair)) .!= tiles)
        # distillation: the loss (the masked column too) and the statistics' maxima and log-sums
        krecs = cat([FusedCE.kd_partial(shard(r), tshard(r); vocab_start = starts[r], vocab_total = Vl)
                     for r in 1:W]...; dims = 3)
        k = FusedCE.kd_combine(krecs; vocab_total = Vl, targets = tl, reduction = :none)
        @test all(isnan.(k.loss) .!= tiles) && all(isnan.(k.row_stats[1:4, :]) .!= tiles)
        tiles && @test approx(k.loss, kdref; rtol = 1e-5, atol = 1e-6)
        # its terms' exchange, from the statistics of the tiling layout (only the terms' ranges are wrong)
        good = cat([FusedCE.kd_partial(rows(Xl, st, 20), rows(Tl, st, 20); vocab_start = st, vocab_total = Vl)
                    for st in (0, 20, 40)]...; dims = 3)
        st = FusedCE.kd_combine(good; vocab_total = Vl, targets = tl, loss = false).row_stats
        trecs = cat([FusedCE.kd_terms_partial(shard(r), tshard(r), st; vocab_start = starts[r], vocab_total = Vl)
                     for r in 1:W]...; dims = 3)
        for r in 1:W
            @test all(reinterpret(Int32, trecs[4:5, :, r]) .== Int32[starts[r], starts[r] + widths[r]])
        end
        tc = FusedCE.kd_terms_combine(trecs, copy(st); vocab_total = Vl, targets = tl, reduction = :none)
        @test all(isnan.(tc.loss) .!= tiles)
    end
end

# A shard of padding alone (vocab_start = vocab_total, as padding V = 60 to 3 ranks of 30 gives): accepted
# (0.2.0 refused it), its records neutral with the range [60, 60), the combines those of the real shards.
@testset "shard layouts: a shard of padding alone is accepted and neutral" begin
    Vl, Nl, w = 60, 4, 30
    Xl = randn(Float32, Vl, Nl) .* 2
    Tl = randn(Float32, Vl, Nl) .* 2
    tl = [5, 30, 59, -100]
    shard(X, r) = r == 3 ? fill(NaN32, w, Nl) : X[(r - 1) * w + 1 : r * w, :]
    opts = (reduction = :none, label_smoothing = 0.1)
    recs = [FusedCE.cross_entropy_partial(shard(Xl, r), tl; vocab_start = (r - 1) * w, vocab_total = Vl, opts...)
            for r in 1:3]
    @test all(reinterpret(Int32, recs[3][5:6, :]) .== Int32(60))
    c3 = FusedCE.cross_entropy_combine(cat(recs...; dims = 3), tl; vocab_total = Vl, opts..., lse = :pair,
                                       entropy = true, argmax = true)
    c2 = FusedCE.cross_entropy_combine(cat(recs[1:2]...; dims = 3), tl; vocab_total = Vl, opts..., lse = :pair,
                                       entropy = true, argmax = true)
    @test c3.loss == c2.loss && c3.lse == c2.lse && c3.entropy == c2.entropy && c3.argmax == c2.argmax
    @test approx(c3.loss, FusedCE.cross_entropy_fwd(Xl, tl; opts...).loss)
    # its backward from the combined pairs: every row is padding, gradient 0
    @test all(FusedCE.cross_entropy_bwd(shard(Xl, 3), tl, c3.lse; vocab_start = 60, vocab_total = Vl, opts...) .== 0)
    # linear cross-entropy: a shard of the LM head without a real column
    hid = randn(Float32, 3, Nl)
    lrec = FusedCE.linear_cross_entropy_partial(hid, fill(NaN32, 3, w), tl; vocab_start = 60, vocab_total = Vl, opts...)
    @test isequal(lrec, recs[3])
    # (its Float32 part of dhidden should be 0 too; the CPU library of 0.2.0 before this fix leaves it unwritten for a shard
    # without a real row, so only dweight is checked)
    d = FusedCE.linear_cross_entropy_bwd(hid, fill(NaN32, 3, w), tl, c3.lse; vocab_start = 60, vocab_total = Vl,
                                         opts..., dhidden = false)
    @test all(d.dweight .== 0)
    # logsumexp, and the padding shard's softmax from the combined pairs: 0 and -Inf
    sc = 1f0 / 0.5f0
    lrecs = [FusedCE.logsumexp_partial(shard(Xl, r); vocab_start = (r - 1) * w, vocab_total = Vl, scale = sc)
             for r in 1:3]
    @test all(reinterpret(Int32, lrecs[3][3:4, :]) .== Int32(60)) && all(lrecs[3][1, :] .== -Inf32)
    lp3 = FusedCE.logsumexp_combine(cat(lrecs...; dims = 3); out = :pair)
    @test lp3 == FusedCE.logsumexp_combine(cat(lrecs[1:2]...; dims = 3); out = :pair)
    sm = FusedCE.temp_softmax(shard(Xl, 3); temperature = 0.5, vocab_start = 60, vocab_total = Vl, lse = lp3,
                              logprobs = true)
    @test all(sm.probs .=== 0.0f0) && all(sm.logprobs .== -Inf32)
    # distillation
    krecs = [FusedCE.kd_partial(shard(Xl, r), shard(Tl, r); vocab_start = (r - 1) * w, vocab_total = Vl) for r in 1:3]
    @test all(reinterpret(Int32, krecs[3][6:7, :]) .== Int32(60))
    k3 = FusedCE.kd_combine(cat(krecs...; dims = 3); vocab_total = Vl)
    @test isfinite(k3.loss) && k3.loss == FusedCE.kd_combine(cat(krecs[1:2]...; dims = 3); vocab_total = Vl).loss
end

# Since 0.2.0 an lse may be its pairs (m, l), 2×N: the backward from them forms every probability from
# max-shifted values. At logits of 2^25 an fp32 lse cannot hold log 2 (its ulp there is 4).
@testset "lse pairs: the backward at a large offset" begin
    big = 33554432.0f0                            # 2^25
    x = reshape(Float32[big, big, 0, 1], 4, 1)    # V×N: one column, target 1 (the C target 0)
    exact = reshape(Float32[-0.5, 0.5, 0, 0], 4, 1)
    r = FusedCE.cross_entropy_fwd(x, [1]; reduction = :none, lse = :pair, dlogits = true)
    @test r.lse isa Matrix{Float32} && size(r.lse) == (2, 1)
    @test r.lse == reshape(Float32[big, log(2f0)], 2, 1)
    @test r.dlogits == exact
    # the backward from the pairs: exact, the fused bits (into a buffer, and in place)
    d = FusedCE.cross_entropy_bwd(x, [1], r.lse; reduction = :none)
    @test d == exact && reinterpret(UInt32, d) == reinterpret(UInt32, r.dlogits)
    y = copy(x)
    @test FusedCE.cross_entropy_bwd(y, [1], r.lse; reduction = :none, dlogits = y) === y && y == exact
    # a caller's 2×N buffer, and the lse of the pairs (rounded to 2^25 in Float32)
    buf = fill(NaN32, 2, 1)
    @test FusedCE.cross_entropy_fwd(x, [1]; reduction = :none, lse = buf).lse === buf && buf == r.lse
    @test lse_from_pairs(r.lse) == [big]
    # from the lse vector (2^25), as documented: p_j = exp(z_j - lse) is 1 for both large logits
    rv = FusedCE.cross_entropy_fwd(x, [1]; reduction = :none)
    @test rv.lse == [big]
    @test FusedCE.cross_entropy_bwd(x, [1], rv.lse; reduction = :none) == reshape(Float32[0, 1, 0, 0], 4, 1)
    # linear cross-entropy: hidden [1], weight columns [2^25, 2^25, 0, 1]: dweight = dlogits' * hidden
    hid = ones(Float32, 1, 1)
    wt = reshape(Float32[big, big, 0, 1], 1, 4)   # H×V
    lr = FusedCE.linear_cross_entropy_fwd(hid, wt, [1]; reduction = :none, lse = :pair, dweight = true)
    @test lr.lse == r.lse && lr.dweight == reshape(exact, 1, 4)
    @test FusedCE.linear_cross_entropy_bwd(hid, wt, [1], lr.lse; reduction = :none, dhidden = false).dweight ==
          reshape(exact, 1, 4)
    # a shard's softmax at T = 1e-3 from the combined pairs: two one-row shards of 1000.5 share the mass
    T = 1f-3
    recs = cat([FusedCE.logsumexp_partial(fill(1000.5f0, 1, 1); vocab_start = r - 1, vocab_total = 2,
                                          scale = 1f0 / T) for r in 1:2]...; dims = 3)
    pr = FusedCE.logsumexp_combine(recs; out = :pair)
    @test pr[1, 1] == 1000.5f0 && isapprox(pr[2, 1], log(2); rtol = 1e-6)
    for r in 1:2
        sm = FusedCE.temp_softmax(fill(1000.5f0, 1, 1); temperature = T, vocab_start = r - 1, vocab_total = 2,
                                  lse = pr, logprobs = true)
        @test isapprox(sm.probs[1, 1], 0.5; rtol = 1e-6) && isapprox(sm.logprobs[1, 1], -log(2); rtol = 1e-6)
    end
    # errors: another element type, a 2×N view whose columns are not contiguous, another size; a symbol
    @test fce_status_name(() -> FusedCE.cross_entropy_bwd(x, [1], Float64.(r.lse); reduction = :none)) ==
          "UNSUPPORTED_DTYPE"
    @test fce_status_name(() -> FusedCE.cross_entropy_bwd(x, [1], view(fill(0f0, 3, 1), 1:2, :);
                                                          reduction = :none)) == "no error"   # N = 1: any stride
    x2 = hcat(x, x)
    @test fce_status_name(() -> FusedCE.cross_entropy_bwd(x2, [1, 1], view(fill(0f0, 3, 2), 1:2, :);
                                                          reduction = :none)) == "UNSUPPORTED_LAYOUT"
    @test fce_status_name(() -> FusedCE.cross_entropy_bwd(x2, [1, 1], fill(0f0, 3, 2); reduction = :none)) ==
          "SHAPE_MISMATCH"
    @test fce_status_name(() -> FusedCE.cross_entropy_fwd(x2, [1, 1]; lse = fill(0f0, 2, 3))) == "SHAPE_MISMATCH"
    @test_throws ArgumentError FusedCE.cross_entropy_fwd(x, [1]; lse = :pairs)
    @test_throws ArgumentError lse_from_pairs(fill(0f0, 3, 2))
end

@testset "bad input raises FusedCEError with the library's message" begin
    function status_of(f)
        try
            f()
        catch e
            e isa FusedCEError || rethrow()
            @test !isempty(e.message)
            @test occursin(string(e.func), sprint(showerror, e))
            return e.name
        end
        return "no error"
    end
    @test status_of(() -> FusedCE.cross_entropy(X, t[1:end-1])) == "SHAPE_MISMATCH"
    @test status_of(() -> FusedCE.cross_entropy(Float64.(X), t)) == "UNSUPPORTED_DTYPE"
    @test status_of(() -> FusedCE.cross_entropy(X, t; label_smoothing = 2)) == "INVALID_ARGUMENT"
    @test status_of(() -> FusedCE.cross_entropy(X, t; logit_scale = 0)) == "INVALID_ARGUMENT"
    @test status_of(() -> FusedCE.cross_entropy(view(randn(Float32, 2V, N), 1:2:2V, :), t)) == "UNSUPPORTED_LAYOUT"
    @test status_of(() -> FusedCE.cross_entropy(X, t; class_weights = ones(Float32, V + 1))) == "SHAPE_MISMATCH"
    @test status_of(() -> FusedCE.logsumexp(X; out = zeros(Float32, N + 1))) == "SHAPE_MISMATCH"
    @test status_of(() -> FusedCE.temp_softmax(X; temperature = -1)) == "INVALID_ARGUMENT"
    @test status_of(() -> FusedCE.temp_softmax(X; probs = false)) == "INVALID_ARGUMENT"
    @test status_of(() -> FusedCE.kd_loss(S, Tt[:, 1:end-1])) == "SHAPE_MISMATCH"
    @test status_of(() -> FusedCE.kd_loss(S, Tt; temperature = 0)) == "INVALID_ARGUMENT"
    # the KD temperature's domain, [FCE_KD_TEMPERATURE_MIN, FCE_KD_TEMPERATURE_MAX] = [1e-4, 100]
    @test status_of(() -> FusedCE.kd_loss(S, Tt; temperature = L.FCE_KD_TEMPERATURE_MIN / 2)) == "INVALID_ARGUMENT"
    @test status_of(() -> FusedCE.kd_loss(S, Tt; temperature = L.FCE_KD_TEMPERATURE_MAX * 1.01f0)) == "INVALID_ARGUMENT"
    for T in (L.FCE_KD_TEMPERATURE_MIN, 1e-4, L.FCE_KD_TEMPERATURE_MAX)
        @test isfinite(FusedCE.kd_loss(S, Tt; temperature = T).loss)
    end
    @test status_of(() -> FusedCE.linear_cross_entropy(randn(Float32, 4, N), randn(Float32, 5, V), t)) == "SHAPE_MISMATCH"
    @test status_of(() -> FusedCE.linear_cross_entropy(randn(Float32, 4, N), randn(Float16, 4, V), t)) == "UNSUPPORTED_DTYPE"
    @test_throws ArgumentError FusedCE.cross_entropy(X, t; reduction = :avg)
    @test_throws ArgumentError FusedCE.kd_loss(S, Tt; divergence = :kl)
    @test_throws ArgumentError FusedCE.cross_entropy(rand(ComplexF32, V, N), t)
    # a CUDA handle: NO_DEVICE on a machine without a GPU, a working handle otherwise
    s = status_of(() -> FusedCE.Handle(:cuda, 0))
    @test s in ("NO_DEVICE", "no error")
    # CPU arrays with a CUDA handle are a device mismatch
    if s == "no error"
        @test status_of(() -> FusedCE.cross_entropy(X, t; handle = FusedCE.Handle(:cuda, 0))) == "DEVICE_MISMATCH"
    end
    # the message is the thread's last error and is cleared by a success
    FusedCE.cross_entropy(X, t)
    @test unsafe_string(L.fce_last_error_message()) == ""
end

end # testset
