/** @file
 * libfusedce — fused kernels for the losses at the end of a language model.
 *
 * This header is the whole public contract. It is valid C99 and C++, includes no CUDA header, and is
 * stable within an ABI version (FCE_ABI_VERSION): functions are only added, structs only grow at the end
 * (each starts with `struct_size`), enum values are only appended.
 *
 * Conventions used by every entry point
 * -------------------------------------
 * Tensors are borrowed DLPack descriptors (`const DLTensor*`, dlpack/dlpack.h, DLPack >= 0.6). The library
 * never keeps a pointer past the call (on CUDA: past the work enqueued on `stream`).
 *   - `device.device_type`: a CPU handle takes kDLCPU and kDLCUDAHost (pinned host memory: the host reads
 *     and writes it directly); a CUDA handle takes kDLCUDA and kDLCUDAManaged whose `device_id` is the
 *     handle's ordinal. Anything else (kDLCUDAHost on a CUDA handle, managed or device memory on a CPU
 *     handle, another ordinal, other device types) is FCE_STATUS_DEVICE_MISMATCH.
 *   - `strides` are in elements, NULL meaning row-major. Matrices [N,V] need unit stride on the last axis
 *     and any row stride >= V (padded rows are fine); vectors need unit stride. A stride of an axis of
 *     extent 1 is ignored. `byte_offset` is honoured. Anything else: FCE_STATUS_UNSUPPORTED_LAYOUT.
 *   - Floating dtypes: fp32 (kDLFloat,32), bf16 (kDLBfloat,16), fp16 (kDLFloat,16); `lanes` must be 1.
 *     Index dtypes: int32 or int64. Every statistic is computed in fp32 or wider, whatever the input.
 *   - A scalar is a tensor of ndim 0, or ndim 1 with shape [1].
 *   - Optional tensors are NULL when absent.
 * Handles: one per device, made by fce_handle_create. A handle may be used by one thread at a time;
 * different handles may be used concurrently from different threads. A call that finds its handle inside
 * another thread's call returns FCE_STATUS_HANDLE_BUSY at once, having done nothing, instead of racing on
 * the handle's state (its cached workspace): give each thread its own handle, or serialize the calls. Every
 * call that takes a handle may return it (fce_handle_destroy then leaves the handle alive) but
 * fce_handle_get_device, which any thread may call at any time. The check is a flag, not a lock: a call
 * never waits for another, and the caller still orders a handle's last calls before its destruction. It
 * covers a call's host side: on CUDA, work a call enqueued runs after the call returns, in stream order.
 * Streams: every call takes the CUDA stream to enqueue on (ignored by CPU handles). CUDA calls are
 * asynchronous, never synchronize the host, never allocate when given a large enough workspace, and may
 * be captured in a CUDA graph. On sm_90 devices the few-row kernels are programmatic dependent launches:
 * they may start launching while the kernel before them in the stream ends, and wait for it to complete
 * before touching memory, so stream order holds as for any kernel.
 * Workspace: each op has a `_workspace_size` query taking the same arguments. Pass a buffer of at least
 * that many bytes on the handle's device, aligned to FCE_WORKSPACE_ALIGNMENT (16) bytes
 * (FCE_STATUS_INVALID_ARGUMENT otherwise), or NULL to let the handle allocate and cache one. The cache
 * grows on the first call that needs more, in the order of that call's stream (cudaMallocAsync, and
 * cudaFreeAsync of the old buffer after the work already enqueued there): the host is not synchronized.
 * Calls on other streams that used the cache must be ordered before such a call, as for any shared
 * buffer; on devices without stream-ordered allocation the old buffer is freed after a device
 * synchronization. The cache cannot grow while the stream is being captured into a CUDA graph
 * (FCE_STATUS_INVALID_ARGUMENT): capture with a caller's workspace, or after a call that sized the cache.
 * The cached workspace is one buffer per handle: calls with NULL on different streams of one handle share
 * it, so pass workspaces (or use one stream per handle) when a handle's calls may run concurrently on
 * several streams.
 * Structs: every options, outputs and teacher struct starts with `uint32_t struct_size`. Fill it with the
 * _INIT macro, or from another language with the matching fce_*_init function. Structs only grow at the
 * end, within an ABI version, and have no tail padding, so new fields start past the old size. The
 * library reads a struct_size that is a size the struct has had (its first published size, or this
 * library's) or larger, up to FCE_MAX_STRUCT_SIZE: a smaller struct than this library's (a caller built
 * against an older header) gets the defaults for the fields it lacks; a larger one (a newer header) is
 * accepted when every byte past the struct this library knows is zero, i.e. the newer options are left at
 * their defaults. A non-zero byte there, or another size, is FCE_STATUS_INVALID_ARGUMENT with the struct's
 * name and this library's version in the message (the rule Linux applies to growing syscall structs).
 * Errors: every function returns an fce_status_t. On failure a per-thread message is available from
 * fce_last_error_message(), and no output tensor has been written (validation precedes all writes).
 * Determinism: results are bitwise identical run to run on the same device and library build (fixed-order
 * reductions, no floating-point atomics), and on a CPU handle whatever the number of threads. The CPU
 * backend's vector kernels are chosen at run time for the CPU's instruction set, so CPUs of different vector
 * widths (e.g. AVX2 and AVX-512) may differ in the last bits.
 */
#ifndef FUSEDCE_FUSEDCE_H_
#define FUSEDCE_FUSEDCE_H_

#include <stddef.h>
#include <stdint.h>

#include <dlpack/dlpack.h>

#ifdef __cplusplus
extern "C" {
#endif

/* ------------------------------------------------------------------------------------------------ */
/* Version and export                                                                               */
/* ------------------------------------------------------------------------------------------------ */

/** Major version of this header: changes on an incompatible change of the API. */
#define FCE_VERSION_MAJOR 0
/** Minor version: changes when functions or struct fields are added. */
#define FCE_VERSION_MINOR 2
/** Patch version: changes for fixes that leave the API as it is. */
#define FCE_VERSION_PATCH 0
/** MAJOR*10000 + MINOR*100 + PATCH. */
#define FCE_VERSION_NUMBER (FCE_VERSION_MAJOR * 10000 + FCE_VERSION_MINOR * 100 + FCE_VERSION_PATCH)
/** Changes only when the binary interface breaks; the shared object is libfusedce.so.FCE_ABI_VERSION. */
#define FCE_ABI_VERSION 0

/** Marks the exported entry points (default visibility; the library hides everything else). */
#if defined(_WIN32)
#define FCE_API
#else
#define FCE_API __attribute__((visibility("default")))
#endif

/** FCE_VERSION_NUMBER of the loaded library (compare with the header's to detect a mismatch). */
FCE_API unsigned fce_version_number(void);
/** "MAJOR.MINOR.PATCH" of the loaded library; static storage, never NULL. */
FCE_API const char* fce_version_string(void);
/** FCE_ABI_VERSION of the loaded library. */
FCE_API unsigned fce_abi_version(void);

/** Required alignment, in bytes, of a caller's workspace. */
#define FCE_WORKSPACE_ALIGNMENT 16
/** Largest struct_size accepted for any struct (a newer header's larger structs stay far below it). */
#define FCE_MAX_STRUCT_SIZE 4096

/* ------------------------------------------------------------------------------------------------ */
/* Status                                                                                           */
/* ------------------------------------------------------------------------------------------------ */

/** Result of every call. Values are pinned; new codes are only appended. */
typedef enum fce_status {
  FCE_STATUS_SUCCESS = 0,
  /** A required pointer is NULL, or an option value is out of its documented domain. */
  FCE_STATUS_INVALID_ARGUMENT = 1,
  /** Tensor ranks or extents disagree with each other or with the op (including zero extents). */
  FCE_STATUS_SHAPE_MISMATCH = 2,
  /** A tensor's dtype is not one the op accepts for that argument. */
  FCE_STATUS_UNSUPPORTED_DTYPE = 3,
  /** Strides the op cannot address (see the conventions above). */
  FCE_STATUS_UNSUPPORTED_LAYOUT = 4,
  /** A tensor lives on another device than the handle. */
  FCE_STATUS_DEVICE_MISMATCH = 5,
  /** Two tensors overlap in memory where the op does not allow aliasing. */
  FCE_STATUS_ALIASING = 6,
  /** A size or byte count overflows 64-bit arithmetic. */
  FCE_STATUS_OVERFLOW = 7,
  /** The caller's workspace is smaller than the op's `_workspace_size`. */
  FCE_STATUS_WORKSPACE_TOO_SMALL = 8,
  /** No usable CUDA device (no driver, stub driver, or no GPU); the message has the CUDA error text. */
  FCE_STATUS_NO_DEVICE = 9,
  /** The op exists in the contract but this backend does not implement it yet. */
  FCE_STATUS_NOT_IMPLEMENTED = 10,
  /** Host or device memory could not be allocated. */
  FCE_STATUS_OUT_OF_MEMORY = 11,
  /** A CUDA runtime call failed; the message has the CUDA error text. */
  FCE_STATUS_CUDA_ERROR = 12,
  /** A cuBLAS or BLAS call failed. */
  FCE_STATUS_BLAS_ERROR = 13,
  /** A bug in the library; please report it with the message. */
  FCE_STATUS_INTERNAL_ERROR = 14,
  /** NCCL cannot be loaded, or an NCCL call failed; the message has NCCL's error text, the communicator's
   *  last error and its asynchronous error (ncclCommGetAsyncError). */
  FCE_STATUS_COMMUNICATOR_ERROR = 15,
  /** The handle is inside another thread's call (a handle takes one thread at a time); nothing was done.
   *  The message names the handle. (Since 0.2.0.) */
  FCE_STATUS_HANDLE_BUSY = 16
} fce_status_t;

/** Short static description of a status; never NULL ("unknown status" for values this build lacks). */
FCE_API const char* fce_status_string(fce_status_t status);
/** Detail of the last failure on the calling thread, "" when the last call succeeded. Valid until the
 *  next libfusedce call on the same thread. Never NULL. */
FCE_API const char* fce_last_error_message(void);

/* ------------------------------------------------------------------------------------------------ */
/* Build information                                                                                */
/* ------------------------------------------------------------------------------------------------ */

/** What the loaded library was built with. Initialize with FCE_BUILD_INFO_INIT (or set struct_size). */
typedef struct fce_build_info {
  uint32_t struct_size;      /**< sizeof(fce_build_info_t) */
  uint32_t version_number;   /**< FCE_VERSION_NUMBER of the library */
  uint32_t abi_version;      /**< FCE_ABI_VERSION of the library */
  int32_t cuda_backend;      /**< 1 when the CUDA backend is built, 0 for a CPU-only build */
  /** CUDA runtime the library was compiled against, as CUDART_VERSION (13000 = 13.0); 0 without CUDA. */
  int32_t cuda_runtime_version;
  /** cuBLAS headers the library was compiled against, as CUBLAS_VERSION (e.g. 130000); 0 without CUDA.
   *  cuBLAS itself is loaded at run time (libcublas.so.MAJOR) on the first linear cross-entropy call. */
  int32_t cublas_version;
  const char* version_string;      /**< "MAJOR.MINOR.PATCH"; static storage */
  /** GPU code compiled into the library, space separated: "sm_80" is machine code for that architecture,
   *  "compute_90" PTX that the driver compiles for newer ones; "" without CUDA. Static storage. */
  const char* cuda_architectures;
} fce_build_info_t;

/** Initializer of fce_build_info_t: struct_size and every default. */
#define FCE_BUILD_INFO_INIT { (uint32_t)sizeof(fce_build_info_t), 0, 0, 0, 0, 0, NULL, NULL }

/**
 * Fills `info` with what the loaded library was built with.
 * @param info struct_size must be at least the library's sizeof(fce_build_info_t) (and at most
 *             FCE_MAX_STRUCT_SIZE); bytes past the fields this library knows are set to zero.
 * @return FCE_STATUS_SUCCESS; FCE_STATUS_INVALID_ARGUMENT (info NULL, struct_size out of range; nothing
 *         written).
 */
FCE_API fce_status_t fce_build_info(fce_build_info_t* info);

/* ------------------------------------------------------------------------------------------------ */
/* Handles and streams                                                                              */
/* ------------------------------------------------------------------------------------------------ */

/** ABI-identical to cudaStream_t and CUstream; NULL is the legacy default stream. */
typedef struct CUstream_st* fce_stream_t;
/** Owns what is costly to make for one device: device properties, BLAS handles, a cached workspace. */
typedef struct fce_handle* fce_handle_t;

/**
 * Creates a handle for one device.
 * @param device_type kDLCPU (device_id ignored, rows run in parallel on all cores) or kDLCUDA.
 * @param device_id   CUDA ordinal for kDLCUDA.
 * @param out         receives the handle; written only on success.
 * @return FCE_STATUS_SUCCESS; FCE_STATUS_INVALID_ARGUMENT (out NULL, other device types, negative
 *         ordinal); FCE_STATUS_NO_DEVICE (no driver, no GPU, ordinal out of range; the message carries the
 *         CUDA error text; also from builds without CUDA); FCE_STATUS_OUT_OF_MEMORY.
 */
FCE_API fce_status_t fce_handle_create(int32_t device_type, int32_t device_id, fce_handle_t* out);
/** Frees the handle and its cached workspace. NULL is accepted. Work still enqueued on CUDA streams
 *  that uses the handle's cached workspace must be complete (the call synchronizes the device).
 *  @return FCE_STATUS_SUCCESS; FCE_STATUS_HANDLE_BUSY (nothing freed) while another thread's call is
 *          inside the handle. */
FCE_API fce_status_t fce_handle_destroy(fce_handle_t handle);
/** Device type (kDLCPU or kDLCUDA) and ordinal of a handle. Either output pointer may be NULL. Any thread
 *  may call it at any time, while another thread's call is inside the handle too (never HANDLE_BUSY). */
FCE_API fce_status_t fce_handle_get_device(fce_handle_t handle, int32_t* device_type, int32_t* device_id);

/* ------------------------------------------------------------------------------------------------ */
/* Shared option values                                                                             */
/* ------------------------------------------------------------------------------------------------ */

/** Reductions of per-row losses (the `reduction` fields). */
typedef enum fce_reduction {
  FCE_REDUCTION_NONE = 0, /**< loss is [N] fp32, one value per row (0 for ignored rows) */
  FCE_REDUCTION_SUM = 1,  /**< loss is a scalar fp32: the sum over rows */
  /** Scalar fp32: the sum divided by the number of non-ignored rows (by the sum of their class weights
   *  when class weights are given, as PyTorch). 0 when every row is ignored (PyTorch gives NaN). For KD
   *  this is "batchmean": divided by the number of unmasked rows. */
  FCE_REDUCTION_MEAN = 2
} fce_reduction_t;

/* ------------------------------------------------------------------------------------------------ */
/* Cross-entropy                                                                                    */
/* ------------------------------------------------------------------------------------------------ */

/**
 * Options of cross-entropy (also used by linear cross-entropy). Initialize with FCE_CE_OPTIONS_INIT.
 *
 * Math, for a row x of logits [V] with target t (all in fp32, the max of the raw row taken first):
 *   z_j   = c * tanh(s * x_j / c)       if softcap c > 0 (Gemma 2), else z_j = s * x_j  (s = logit_scale)
 *   lse   = log(sum_j exp(z_j))
 *   nll   = lse - z_t
 *   with class weights w [V] and label smoothing e (PyTorch's definition, torch.nn.functional.cross_entropy):
 *   loss  = (1 - e) * w_t * (lse - z_t) + (e / V) * sum_j w_j * (lse - z_j)   (w = 1 without weights)
 *         + q * lse^2                                                       (z-loss, PaLM; q = z_loss_scale,
 *                                                                              not weighted)
 * Rows whose target equals ignore_index have loss 0, z-loss 0 and zero gradient. A target outside [0, V)
 * that is not ignore_index is not an error status (detecting it on the GPU would need a host sync): that
 * row's loss and z-loss are NaN (so a sum or mean is NaN) and its dlogits row is NaN, loudly.
 * lse, argmax and entropy are reported for every row, ignored or not.
 */
typedef struct fce_ce_options {
  uint32_t struct_size;   /**< sizeof(fce_ce_options_t) */
  int32_t reduction;      /**< fce_reduction_t; default FCE_REDUCTION_MEAN */
  int64_t ignore_index;   /**< targets equal to this are ignored; default -100 */
  float label_smoothing;  /**< e in [0, 1]; default 0 */
  float z_loss_scale;     /**< q >= 0 (PaLM uses 1e-4); default 0 */
  float softcap;          /**< c >= 0, 0 = off (Gemma 2 uses 30); default 0 */
  float logit_scale;      /**< s > 0, finite; multiplies logits (1/temperature); default 1 */
  /** Optional class weights [V], fp32, finite and >= 0 (PyTorch `weight`). NULL = all ones. With a
   *  vocabulary shard: the weights of the whole vocabulary, [vocab_total]. */
  const DLTensor* class_weights;
  /* Since 0.2.0. */
  /** Vocabulary-parallel calls (see "Vocabulary-parallel cross-entropy"): the global index of the logits'
   *  first column; 0 otherwise. */
  int64_t vocab_start;
  /** Vocabulary-parallel calls: V of the whole vocabulary (the logits are columns [vocab_start,
   *  vocab_start + their width) of it; columns at or past vocab_total are padding). 0 = not sharded. */
  int64_t vocab_total;
} fce_ce_options_t;

/** Initializer of fce_ce_options_t: struct_size and every default. */
#define FCE_CE_OPTIONS_INIT \
  { (uint32_t)sizeof(fce_ce_options_t), FCE_REDUCTION_MEAN, -100, 0.0f, 0.0f, 0.0f, 1.0f, NULL, 0, 0 }

/** Fills the struct_size bytes at `options` with this library's defaults, for callers that cannot use
 *  FCE_CE_OPTIONS_INIT (FFI): the fields it knows get the macro's values, bytes past them are zeroed, and
 *  options->struct_size is set to `struct_size`. Pass sizeof(fce_ce_options_t) as your header defines it.
 *  @return FCE_STATUS_SUCCESS; FCE_STATUS_INVALID_ARGUMENT when options is NULL or struct_size is below
 *  the struct's first published size or above FCE_MAX_STRUCT_SIZE (nothing written). */
FCE_API fce_status_t fce_ce_options_init(fce_ce_options_t* options, size_t struct_size);

/**
 * Outputs of fce_cross_entropy_fwd. Initialize with FCE_CE_OUTPUTS_INIT; every field but `loss` optional.
 */
typedef struct fce_ce_outputs {
  uint32_t struct_size; /**< sizeof(fce_ce_outputs_t) */
  /** Required. fp32: [N] for FCE_REDUCTION_NONE, a scalar otherwise. Nats. */
  DLTensor* loss;
  /** The logsumexp of the transformed logits z, fp32, in one of two forms (save it for
   *  fce_cross_entropy_bwd): [N], the lse itself; or [N, 2] contiguous, its pair (m, l), m = max_j z_j and
   *  l = log sum_j exp(z_j - m), lse = m + l (since 0.2.0). The backward forms every probability from the
   *  pair as the forward does, p_j = exp((z_j - m) - l), so its gradient holds docs/numerics.md's bound
   *  whatever the logits' common offset and gives the fused gradient's bits; from the [N] form each p_j
   *  carries the lse's fp32 rounding, up to |lse| 2^-24 relative (6e-3 at |lse| = 1e5). */
  DLTensor* lse;
  /** The z-loss part of `loss` (q * lse^2 per non-ignored row), shaped and reduced like `loss`. */
  DLTensor* z_loss;
  /** [N] int32 or int64: index of the largest raw logit, lowest index on ties (NaN counts as largest). */
  DLTensor* argmax;
  /** [N] fp32: entropy of softmax(z) in nats, H = -sum_j p_j log p_j (differentiated through
   *  grad_entropy). */
  DLTensor* entropy;
  /** [N,V] in the logits' dtype: d(loss)/d(logits) times grad_loss, formed in fp32 and rounded once.
   *  May be the very same memory as the logits (in-place); any other overlap is FCE_STATUS_ALIASING. */
  DLTensor* dlogits;
  /** Upstream gradient for dlogits, fp32: a scalar for SUM/MEAN, [N] (or a scalar, broadcast) for NONE.
   *  NULL = 1. Read on the device, so it may be produced by earlier work on the same stream. */
  const DLTensor* grad_loss;
  /* Since 0.2.0. */
  /** Upstream gradient of the entropy, fp32, [N] or a scalar (broadcast); NULL = none. Only with dlogits:
   *  dlogits then also holds grad_entropy_i * dH_i/d(logits), in the same pass and the same single
   *  rounding, for every row (ignored rows included: the entropy is reported for them too), with
   *  dH/dz_j = p_j (mu - z_j), mu = sum_k p_k z_k = lse - H, chained through logit_scale and softcap as
   *  the loss gradient is (the entropy's derivative, e.g. Pereyra et al. 2017). A logit of -inf (p_j = 0)
   *  gets 0. Read on the device. */
  const DLTensor* grad_entropy;
} fce_ce_outputs_t;

/** Initializer of fce_ce_outputs_t: struct_size and every default. */
#define FCE_CE_OUTPUTS_INIT { (uint32_t)sizeof(fce_ce_outputs_t), NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL }

/** Fills the struct_size bytes at `outputs` with this library's defaults, for callers that cannot use
 *  FCE_CE_OUTPUTS_INIT (FFI): the fields it knows get the macro's values, bytes past them are zeroed, and
 *  outputs->struct_size is set to `struct_size`. Pass sizeof(fce_ce_outputs_t) as your header defines it.
 *  @return FCE_STATUS_SUCCESS; FCE_STATUS_INVALID_ARGUMENT when outputs is NULL or struct_size is below
 *  the struct's first published size or above FCE_MAX_STRUCT_SIZE (nothing written). */
FCE_API fce_status_t fce_ce_outputs_init(fce_ce_outputs_t* outputs, size_t struct_size);

/**
 * Cross-entropy forward over a large vocabulary by online softmax (Milakov & Gimelshein 2018), never
 * materializing the softmax; the gradient is fused into the same pass when outputs->dlogits is set.
 * @param logits  [N,V] fp32, bf16 or fp16.
 * @param targets [N] int32 or int64.
 * @param options NULL for the defaults (FCE_CE_OPTIONS_INIT).
 * @return FCE_STATUS_SUCCESS, or the validation statuses (INVALID_ARGUMENT for NULL handle/logits/targets/
 *         outputs/loss or options out of domain, or options->vocab_total set: a shard's loss comes from
 *         fce_cross_entropy_partial and fce_cross_entropy_combine; SHAPE_MISMATCH; UNSUPPORTED_DTYPE;
 *         UNSUPPORTED_LAYOUT; DEVICE_MISMATCH; ALIASING; OVERFLOW; WORKSPACE_TOO_SMALL), NOT_IMPLEMENTED,
 *         CUDA_ERROR.
 */
FCE_API fce_status_t fce_cross_entropy_fwd(fce_handle_t handle, fce_stream_t stream, const DLTensor* logits,
                                           const DLTensor* targets, const fce_ce_options_t* options,
                                           const fce_ce_outputs_t* outputs, void* workspace,
                                           size_t workspace_bytes);
/** Workspace bytes fce_cross_entropy_fwd needs for these arguments (same validation). */
FCE_API fce_status_t fce_cross_entropy_fwd_workspace_size(fce_handle_t handle, const DLTensor* logits,
                                                          const DLTensor* targets,
                                                          const fce_ce_options_t* options,
                                                          const fce_ce_outputs_t* outputs, size_t* bytes);

/**
 * Cross-entropy backward from a saved logsumexp: dlogits = d(loss)/d(logits) * grad_loss. With a vocabulary
 * shard (options->vocab_total > 0): the shard's dlogits from the lse of fce_cross_entropy_combine, targets
 * being global indices; padding columns (global index >= vocab_total) get 0.
 * @param logits    [N,V] fp32, bf16 or fp16 (as given to the forward).
 * @param targets   [N] int32 or int64.
 * @param lse       [N] fp32, or its pairs [N, 2] (fce_ce_outputs_t.lse), from fce_cross_entropy_fwd with the
 *                  same options (a shard: from fce_cross_entropy_combine). Probabilities are formed from it
 *                  as exp((z_j - m) - l), (m, l) = (lse, 0) for the [N] form.
 * @param grad_loss fp32 scalar (SUM/MEAN) or [N] or scalar (NONE); NULL = 1.
 * @param options   the forward's options (NULL = defaults).
 * @param dlogits   [N,V] in the logits' dtype; may be the logits' memory (in-place).
 * @return as fce_cross_entropy_fwd.
 */
FCE_API fce_status_t fce_cross_entropy_bwd(fce_handle_t handle, fce_stream_t stream, const DLTensor* logits,
                                           const DLTensor* targets, const DLTensor* lse,
                                           const DLTensor* grad_loss, const fce_ce_options_t* options,
                                           DLTensor* dlogits, void* workspace, size_t workspace_bytes);
/** Workspace bytes fce_cross_entropy_bwd needs for these arguments. */
FCE_API fce_status_t fce_cross_entropy_bwd_workspace_size(fce_handle_t handle, const DLTensor* logits,
                                                          const DLTensor* targets, const DLTensor* lse,
                                                          const DLTensor* grad_loss,
                                                          const fce_ce_options_t* options,
                                                          const DLTensor* dlogits, size_t* bytes);

/**
 * What the backward from saved statistics reads (fce_cross_entropy_bwd_ex): the forward's saved outputs and
 * the upstream gradients. Initialize with FCE_CE_BWD_INPUTS_INIT.
 */
typedef struct fce_ce_bwd_inputs {
  uint32_t struct_size;          /**< sizeof(fce_ce_bwd_inputs_t) */
  const DLTensor* lse;           /**< required: [N] or [N, 2] fp32, the forward's lse (same options) */
  /** Upstream gradient of the loss, as fce_cross_entropy_bwd's grad_loss; NULL = 1. */
  const DLTensor* grad_loss;
  /** [N] fp32, the forward's entropy output (same options); required with grad_entropy, else ignored. The
   *  backward takes mu = lse - H from it rather than re-reading the logits for sum p z. */
  const DLTensor* entropy;
  /** Upstream gradient of the entropy, fp32, [N] or a scalar; NULL = none (fce_ce_outputs_t.grad_entropy). */
  const DLTensor* grad_entropy;
} fce_ce_bwd_inputs_t;

/** Initializer of fce_ce_bwd_inputs_t: struct_size and every default. */
#define FCE_CE_BWD_INPUTS_INIT { (uint32_t)sizeof(fce_ce_bwd_inputs_t), NULL, NULL, NULL, NULL }

/** Fills the struct_size bytes at `inputs` with this library's defaults (as fce_ce_outputs_init).
 *  @return FCE_STATUS_SUCCESS; FCE_STATUS_INVALID_ARGUMENT when inputs is NULL or struct_size is out of
 *  range (nothing written). */
FCE_API fce_status_t fce_ce_bwd_inputs_init(fce_ce_bwd_inputs_t* inputs, size_t struct_size);

/**
 * Cross-entropy backward from saved statistics with the entropy's upstream gradient as well:
 * dlogits = grad_loss * d(loss)/d(logits) + grad_entropy * dH/d(logits), formed in fp32 and rounded once.
 * Without grad_entropy it is fce_cross_entropy_bwd (the same bits). With a vocabulary shard, lse and entropy
 * are fce_cross_entropy_combine's (the same on every rank).
 * @param inputs  lse required; entropy required when grad_entropy is set.
 * @return as fce_cross_entropy_bwd (INVALID_ARGUMENT for a NULL inputs or inputs->lse, or grad_entropy
 *         without entropy).
 */
FCE_API fce_status_t fce_cross_entropy_bwd_ex(fce_handle_t handle, fce_stream_t stream, const DLTensor* logits,
                                              const DLTensor* targets, const fce_ce_bwd_inputs_t* inputs,
                                              const fce_ce_options_t* options, DLTensor* dlogits, void* workspace,
                                              size_t workspace_bytes);
/** Workspace bytes fce_cross_entropy_bwd_ex needs for these arguments. */
FCE_API fce_status_t fce_cross_entropy_bwd_ex_workspace_size(fce_handle_t handle, const DLTensor* logits,
                                                             const DLTensor* targets,
                                                             const fce_ce_bwd_inputs_t* inputs,
                                                             const fce_ce_options_t* options,
                                                             const DLTensor* dlogits, size_t* bytes);

/* ------------------------------------------------------------------------------------------------ */
/* Vocabulary-parallel cross-entropy                                                                */
/* ------------------------------------------------------------------------------------------------ */

/**
 * When the vocabulary is split across W ranks (tensor parallelism: rank r holds columns
 * [vocab_start_r, vocab_start_r + V_r) of every row; shards may be uneven, and padded past vocab_total),
 * the loss of a row needs statistics of every shard. With options->vocab_start and vocab_total set:
 *   1. each rank: fce_cross_entropy_partial -> records [N, K] fp32 of its shard (K from
 *      fce_cross_entropy_record_fields);
 *   2. the caller gathers the records of all ranks in rank order (an all-gather: [W, N, K]);
 *   3. each rank: fce_cross_entropy_combine -> what fce_cross_entropy_fwd returns for the whole rows
 *      (loss, lse, z_loss, argmax, entropy), the same bits on every rank;
 *   4. each rank: fce_cross_entropy_bwd with the combined lse -> its shard's dlogits.
 * Records are merged in rank order (no float all-reduce): bitwise reproducible whatever the communicator,
 * and a NaN anywhere reaches every rank. Ranks must be in vocabulary order (argmax ties go to the lower
 * index). Against the unsharded call: argmax, ignore_index handling, NaN and out-of-range targets,
 * all-ignored means are bitwise equal; the loss, lse and entropy agree within the fp32 rounding of the
 * records' sums (docs/numerics.md).
 * Record fields, per row and shard (z the transformed logits of the shard's real columns, m their max):
 *   0 m, 1 sum exp(z - m), 2 z at the target if the shard holds it (else 0), 3 sum w_j z_j (label
 *   smoothing; 0 without it), 4 and 5 the shard's column range [vocab_start, end) with end one past its last
 *   real column (int32 bits), 6 sum exp(z - m) (z - m) (entropy), 7 the largest raw logit, 8 its global
 *   index (int32 bits). (0.2.0 added the range and renumbered the last three: 0.1.0's widths were 4, 5, 7.)
 * A record may be narrower, a prefix of these fields: FCE_CE_RECORD_FIELDS_LOSS (6) for the loss, lse and
 * z-loss, FCE_CE_RECORD_FIELDS_ENTROPY (7) with the entropy as well, FCE_CE_RECORD_FIELDS_ALL (9) with the
 * argmax. The partial writes what the records' width holds and skips the sums it does not (the entropy's
 * costs the partial time); the all-gather moves fewer bytes. Every rank uses the same width.
 * The combine checks the layout from the ranges: in rank order they must tile [0, vocab_total), the first
 * beginning at 0 and each where the one before ends. Overlapping shards, a gap, shards out of vocabulary
 * order or another vocab_total give NaN loss, lse, z_loss and entropy and argmax -1 in every row (ignored
 * rows included), never a plausible number (no status: the records may be on the device). A shard of
 * padding alone (vocab_start = vocab_total, as padding a small vocabulary to a multiple of the ranks gives)
 * has the empty range [vocab_total, vocab_total) and a neutral record.
 * The caller all-gathers the records with any communicator, or lets the library do it over NCCL
 * (fce_cross_entropy_fwd_vp below: partial, all-gather, combine and gradient in one call).
 */

/** Record width for the loss, lse and z-loss only (fields 0-5). */
#define FCE_CE_RECORD_FIELDS_LOSS 6
/** Record width that adds the entropy (fields 0-6). */
#define FCE_CE_RECORD_FIELDS_ENTROPY 7
/** Record width with every field (0-8): what fce_cross_entropy_record_fields returns. */
#define FCE_CE_RECORD_FIELDS_ALL 9

/** Fields K of a full cross-entropy record for these options (NULL = defaults): FCE_CE_RECORD_FIELDS_ALL.
 *  @return FCE_STATUS_SUCCESS; INVALID_ARGUMENT (nothing written) when fields is NULL or the options are
 *  invalid, checked as every cross-entropy call checks them (struct_size, reduction, label_smoothing,
 *  z_loss_scale, softcap, logit_scale, vocab_start and vocab_total), but for class_weights: a tensor whose
 *  device and length the calls that take the logits check. */
FCE_API fce_status_t fce_cross_entropy_record_fields(const fce_ce_options_t* options, int64_t* fields);

/**
 * The records of a vocabulary shard.
 * @param logits  [N,V] fp32, bf16 or fp16: the shard's columns (V >= 1, possibly padded past vocab_total).
 * @param targets [N] int32 or int64, global indices (as for the unsharded call).
 * @param options vocab_start and vocab_total required (0 <= vocab_start <= vocab_total <= 2^31 - 1;
 *                vocab_start = vocab_total: a shard of padding alone); class weights, if any, of the whole
 *                vocabulary.
 * @param records [N,K] fp32, written; K one of the record widths (FCE_CE_RECORD_FIELDS_*).
 * @return FCE_STATUS_SUCCESS or the validation statuses (INVALID_ARGUMENT without a shard in the options;
 *         SHAPE_MISMATCH for another K), CUDA_ERROR.
 */
FCE_API fce_status_t fce_cross_entropy_partial(fce_handle_t handle, fce_stream_t stream, const DLTensor* logits,
                                               const DLTensor* targets, const fce_ce_options_t* options,
                                               DLTensor* records);

/**
 * The cross-entropy forward of whole rows from the records of all shards.
 * @param records [W,N,K] fp32: every rank's records, in rank (vocabulary) order; K one of the record widths.
 * @param targets [N] int32 or int64, global indices.
 * @param options the partial calls' options (vocab_total required; vocab_start is not read).
 * @param outputs as for fce_cross_entropy_fwd, without dlogits and grad_loss (INVALID_ARGUMENT if set);
 *                entropy needs K >= FCE_CE_RECORD_FIELDS_ENTROPY and argmax K = FCE_CE_RECORD_FIELDS_ALL
 *                (INVALID_ARGUMENT otherwise). lse [N] or its pairs [N, 2] (m the rows' max z over every
 *                shard, l the log of the shifted sum): the pairs are what a shard's backward should take
 *                (fce_ce_outputs_t.lse).
 * @return FCE_STATUS_SUCCESS or the validation statuses, CUDA_ERROR. Records whose ranges do not tile the
 *         vocabulary are not a status: those rows are NaN (see above).
 */
FCE_API fce_status_t fce_cross_entropy_combine(fce_handle_t handle, fce_stream_t stream, const DLTensor* records,
                                               const DLTensor* targets, const fce_ce_options_t* options,
                                               const fce_ce_outputs_t* outputs, void* workspace,
                                               size_t workspace_bytes);
/** Workspace bytes fce_cross_entropy_combine needs for these arguments (same validation). */
FCE_API fce_status_t fce_cross_entropy_combine_workspace_size(fce_handle_t handle, const DLTensor* records,
                                                              const DLTensor* targets,
                                                              const fce_ce_options_t* options,
                                                              const fce_ce_outputs_t* outputs, size_t* bytes);

/* NCCL mode ----------------------------------------------------------------------------------------- */
/*
 * The library runs the exchange itself over a caller's NCCL communicator. NCCL is loaded at run time
 * (dlopen("libnccl.so.2") on the first fce_comm_create), never linked: a process that already has NCCL
 * (PyTorch) shares its copy. The caller keeps NCCL's rules: every rank makes the same calls in the same
 * order; no call inside an open ncclGroupStart/End; one thread per communicator at a time; the stream
 * waits for the all-gather like for any NCCL collective (no host synchronization; CUDA-graph capturable
 * when the communicator allows capture).
 */

/** NCCL's communicator: ncclComm_t is `struct ncclComm*`, so this header need not include nccl.h. */
struct ncclComm;
/** A borrowed NCCL communicator, with its rank and size. */
typedef struct fce_comm* fce_comm_t;

/**
 * Borrows an NCCL communicator for the vocabulary-parallel calls (not owned: destroy `comm` before it).
 * @param handle    a CUDA handle on the communicator's device.
 * @param nccl_comm the caller's ncclComm_t (initialized; a non-blocking one must have finished initializing).
 * @param out       the new communicator object.
 * @return FCE_STATUS_SUCCESS; INVALID_ARGUMENT (NULL arguments, a CPU handle); DEVICE_MISMATCH (the
 *         communicator is on another device than the handle); COMMUNICATOR_ERROR (NCCL cannot be loaded, or
 *         ncclCommCount/UserRank/CuDevice fail).
 */
FCE_API fce_status_t fce_comm_create(fce_handle_t handle, struct ncclComm* nccl_comm, fce_comm_t* out);
/** Releases the object (the NCCL communicator stays the caller's). NULL is a no-op. */
FCE_API fce_status_t fce_comm_destroy(fce_comm_t comm);
/** This rank and the number of ranks W (either pointer may be NULL, not both). */
FCE_API fce_status_t fce_comm_info(fce_comm_t comm, int32_t* rank, int32_t* size);

/**
 * Vocabulary-parallel cross-entropy over NCCL, one call per rank: the records of this rank's shard
 * (fce_cross_entropy_partial), one all-gather of the [N, K] fp32 records on `stream`, their combine in rank
 * order (fce_cross_entropy_combine: every rank gets the same bits, equal to a one-device emulation of the
 * same shards), and, when outputs->dlogits is set, this shard's dlogits times grad_loss from the combined
 * lse (fce_cross_entropy_bwd with the shard). Ranks must hold the shards in vocabulary order (rank r the
 * columns of vocab_start_r).
 * @param comm    from fce_comm_create, on the handle's device.
 * @param logits  [N,V] fp32, bf16 or fp16: this rank's columns (may be padded past vocab_total).
 * @param targets [N] int32 or int64, global indices; the same on every rank.
 * @param options vocab_start (this rank's first column) and vocab_total required; the other options as for
 *                fce_cross_entropy_fwd and the same on every rank.
 * @param outputs as for fce_cross_entropy_fwd (loss required; lse, z_loss, argmax, entropy of the whole
 *                rows; dlogits [N,V] in the logits' dtype, may be the logits' memory; grad_loss;
 *                grad_entropy, whose term uses the combined lse and entropy, as fce_cross_entropy_bwd_ex).
 * @param workspace as everywhere (fce_cross_entropy_fwd_vp_workspace_size): the records of all W ranks
 *                (N * K * 4 * (W + 1) bytes, K the narrowest record width the outputs allow) and the steps'
 *                own.
 * @return FCE_STATUS_SUCCESS, the validation statuses (INVALID_ARGUMENT for NULL comm or without
 *         vocab_total; DEVICE_MISMATCH), COMMUNICATOR_ERROR (the all-gather failed), CUDA_ERROR.
 */
FCE_API fce_status_t fce_cross_entropy_fwd_vp(fce_handle_t handle, fce_comm_t comm, fce_stream_t stream,
                                              const DLTensor* logits, const DLTensor* targets,
                                              const fce_ce_options_t* options, const fce_ce_outputs_t* outputs,
                                              void* workspace, size_t workspace_bytes);
/** Workspace bytes fce_cross_entropy_fwd_vp needs for these arguments (same validation). */
FCE_API fce_status_t fce_cross_entropy_fwd_vp_workspace_size(fce_handle_t handle, fce_comm_t comm,
                                                             const DLTensor* logits, const DLTensor* targets,
                                                             const fce_ce_options_t* options,
                                                             const fce_ce_outputs_t* outputs, size_t* bytes);

/* ------------------------------------------------------------------------------------------------ */
/* Logsumexp                                                                                        */
/* ------------------------------------------------------------------------------------------------ */

/** Options of fce_logsumexp. Initialize with FCE_LSE_OPTIONS_INIT. */
typedef struct fce_lse_options {
  uint32_t struct_size; /**< sizeof(fce_lse_options_t) */
  float scale;          /**< s > 0, finite: lse_i = log sum_j exp(s * x_ij); default 1 */
  /** A shard of the vocabulary (since 0.2.0; fce_logsumexp_partial / _combine): the global index of its first
   *  column; default 0. */
  int64_t vocab_start;
  /** The whole vocabulary's size, 0 (default) when x is not a shard. fce_logsumexp refuses a shard. */
  int64_t vocab_total;
} fce_lse_options_t;

/** Initializer of fce_lse_options_t: struct_size and every default. */
#define FCE_LSE_OPTIONS_INIT { (uint32_t)sizeof(fce_lse_options_t), 1.0f, 0, 0 }

/** Fills the struct_size bytes at `options` with this library's defaults, for callers that cannot use
 *  FCE_LSE_OPTIONS_INIT (FFI): the fields it knows get the macro's values, bytes past them are zeroed, and
 *  options->struct_size is set to `struct_size`. Pass sizeof(fce_lse_options_t) as your header defines it.
 *  @return FCE_STATUS_SUCCESS; FCE_STATUS_INVALID_ARGUMENT when options is NULL or struct_size is below
 *  the struct's first published size or above FCE_MAX_STRUCT_SIZE (nothing written). */
FCE_API fce_status_t fce_lse_options_init(fce_lse_options_t* options, size_t struct_size);

/**
 * Per-row logsumexp: lse_i = log(sum_j exp(s * x_ij)), max of the raw row first. Rows of few rows are split
 * across blocks on the GPU and merged in a fixed order. A row of all -inf gives -inf; NaN propagates.
 * @param x   [N,V] fp32, bf16 or fp16, N >= 1, V >= 1.
 * @param lse [N] fp32.
 * @return FCE_STATUS_SUCCESS or the validation statuses.
 */
FCE_API fce_status_t fce_logsumexp(fce_handle_t handle, fce_stream_t stream, const DLTensor* x,
                                   const fce_lse_options_t* options, DLTensor* lse, void* workspace,
                                   size_t workspace_bytes);
/** Workspace bytes fce_logsumexp needs for these arguments. */
FCE_API fce_status_t fce_logsumexp_workspace_size(fce_handle_t handle, const DLTensor* x,
                                                  const fce_lse_options_t* options, const DLTensor* lse,
                                                  size_t* bytes);

/* Vocabulary-parallel logsumexp: x split across ranks by columns (options->vocab_start and vocab_total as
 * for cross-entropy; uneven and padded shards allowed, and a shard of padding alone). Each rank's
 * fce_logsumexp_partial writes records [N, FCE_LSE_RECORD_FIELDS] fp32 of its shard: 0 m = the max of the
 * raw x over its real columns (NaN when one is NaN), 1 sum exp((x - m) s) (1 when m is +inf, 0 when it is
 * -inf), 2 and 3 its column range [vocab_start, end) (int32 bits, as cross-entropy's records), 4 the scale
 * s, 5 vocab_total (int32 bits). In raw units, so that s x never overflows (a small T keeps every value
 * finite). The caller gathers every rank's records in rank order ([W, N, K]); fce_logsumexp_combine returns
 * the lse of the whole rows, the same bits on every rank: s M + log sum_r d_r exp((m_r - M) s) in fp64 in
 * rank order, NaN when a record is NaN, when the records' scales or vocab_total differ or their ranges do not
 * tile [0, vocab_total) in rank order, +inf when a max is +inf, -inf for rows of all -inf, as fce_logsumexp
 * gives them. Into an [N, 2] lse it writes the pairs (M, log D), lse = s M + log D: the form a shard's
 * softmax takes at any T without overflow or the rounding of a large lse. With scale 1/T this is the lse that
 * fce_temp_softmax takes for a shard's probabilities. (0.2.0: raw maxima, the range, scale and vocab_total;
 * 0.2.0's records had 2 fields.) */

/** Fields of a logsumexp record (fce_logsumexp_partial). */
#define FCE_LSE_RECORD_FIELDS 6

/**
 * The records of a vocabulary shard of x.
 * @param x       [N,V] fp32, bf16 or fp16: the shard's columns (V >= 1, may be padded past vocab_total).
 * @param options vocab_start and vocab_total required (0 <= vocab_start <= vocab_total <= 2^31 - 1); scale
 *                as for fce_logsumexp (for a shard's softmax at T, the fp32 value 1.0f / T that
 *                fce_temp_softmax forms).
 * @param records [N, FCE_LSE_RECORD_FIELDS] fp32, written.
 * @return FCE_STATUS_SUCCESS or the validation statuses (INVALID_ARGUMENT without a shard), CUDA_ERROR.
 */
FCE_API fce_status_t fce_logsumexp_partial(fce_handle_t handle, fce_stream_t stream, const DLTensor* x,
                                           const fce_lse_options_t* options, DLTensor* records);

/**
 * The logsumexp of whole rows from every shard's records.
 * @param records [W, N, FCE_LSE_RECORD_FIELDS] fp32, contiguous, in rank (vocabulary) order.
 * @param lse     [N] fp32, or the pairs [N, 2] fp32 (since 0.2.0), written.
 * @return FCE_STATUS_SUCCESS or the validation statuses, CUDA_ERROR.
 */
FCE_API fce_status_t fce_logsumexp_combine(fce_handle_t handle, fce_stream_t stream, const DLTensor* records,
                                           DLTensor* lse);

/**
 * Vocabulary-parallel logsumexp over NCCL (NCCL mode, under fce_comm_create), one call per rank: the
 * records of this rank's shard (fce_logsumexp_partial), one all-gather of the [N, FCE_LSE_RECORD_FIELDS]
 * fp32 records on `stream`, their combine in rank order (fce_logsumexp_combine). Every rank gets the same
 * bits, equal to those two calls on every shard's records on one device. No host synchronization; with a
 * caller workspace, capturable in a CUDA graph. Since 0.2.0.
 * @param comm    from fce_comm_create, on the handle's device.
 * @param x       [N,V] fp32, bf16 or fp16: this rank's columns (may be padded past vocab_total).
 * @param options required: vocab_start (this rank's first column), vocab_total and scale, the last two the
 *                same on every rank (ranks hold the shards in vocabulary order).
 * @param lse     [N] fp32, or its pairs [N, 2] (fce_logsumexp_combine): the whole rows' lse of scale * x,
 *                written on every rank.
 * @param workspace as everywhere (fce_logsumexp_vp_workspace_size): every rank's records, N * 24 * (W + 1)
 *                bytes.
 * @return FCE_STATUS_SUCCESS, the validation statuses of fce_logsumexp_partial (INVALID_ARGUMENT for NULL
 *         comm or options, or without vocab_total; DEVICE_MISMATCH), COMMUNICATOR_ERROR (the all-gather
 *         failed), CUDA_ERROR.
 */
FCE_API fce_status_t fce_logsumexp_vp(fce_handle_t handle, fce_comm_t comm, fce_stream_t stream, const DLTensor* x,
                                      const fce_lse_options_t* options, DLTensor* lse, void* workspace,
                                      size_t workspace_bytes);
/** Workspace bytes fce_logsumexp_vp needs for these arguments (same validation). */
FCE_API fce_status_t fce_logsumexp_vp_workspace_size(fce_handle_t handle, fce_comm_t comm, const DLTensor* x,
                                                     const fce_lse_options_t* options, const DLTensor* lse,
                                                     size_t* bytes);

/* ------------------------------------------------------------------------------------------------ */
/* Temperature softmax                                                                              */
/* ------------------------------------------------------------------------------------------------ */

/** Options of fce_temp_softmax. Initialize with FCE_SOFTMAX_OPTIONS_INIT. */
typedef struct fce_softmax_options {
  uint32_t struct_size; /**< sizeof(fce_softmax_options_t) */
  /** Temperature of every row when `temperatures` is NULL. Must be >= 0 and not NaN
   *  (FCE_STATUS_INVALID_ARGUMENT otherwise); +inf gives the uniform distribution over finite logits. */
  float temperature;
  /** Optional per-row temperatures [N] fp32, read on the device. A row whose temperature is negative or
   *  NaN gets NaN in every output element of that row (it cannot be reported without a host sync). */
  const DLTensor* temperatures;
  /** A shard of the vocabulary (since 0.2.0): the global index of its first column; default 0. */
  int64_t vocab_start;
  /** The whole vocabulary's size, 0 (default) when the logits are not a shard. With a shard the call writes
   *  the shard's probabilities of the whole rows from `lse`: log p_j = x_j / T - lse, p_j its exp (padding
   *  columns: 0 and -inf); T must be finite and > 0 and `temperatures` NULL (else
   *  FCE_STATUS_NOT_IMPLEMENTED). */
  int64_t vocab_total;
  /** With a shard, required: the rows' logsumexp of logits / T over the whole vocabulary
   *  (fce_logsumexp_combine of every shard's fce_logsumexp_partial with scale 1.0f / T), fp32, as its pairs
   *  [N, 2] (M, log D) or as [N]. From the pairs, log p_j = (x_j - M) / T - log D, formed as the unsharded
   *  call forms it: no NaN for finite logits at any T > 0, and no rounding of the size of x / T. From [N],
   *  ((x_j - u_hi) - u_lo) / T with u = lse T: finite wherever lse is, but every value carries the lse's
   *  rounding (|lse| 2^-24: at T = 1e-3 and logits of 65504 the probabilities are off by e^2), and an lse
   *  that overflowed fp32 gives probabilities 0. */
  const DLTensor* lse;
} fce_softmax_options_t;

/** Initializer of fce_softmax_options_t: struct_size and every default. */
#define FCE_SOFTMAX_OPTIONS_INIT { (uint32_t)sizeof(fce_softmax_options_t), 1.0f, NULL, 0, 0, NULL }

/** Fills the struct_size bytes at `options` with this library's defaults, for callers that cannot use
 *  FCE_SOFTMAX_OPTIONS_INIT (FFI): the fields it knows get the macro's values, bytes past them are zeroed, and
 *  options->struct_size is set to `struct_size`. Pass sizeof(fce_softmax_options_t) as your header defines it.
 *  @return FCE_STATUS_SUCCESS; FCE_STATUS_INVALID_ARGUMENT when options is NULL or struct_size is below
 *  the struct's first published size or above FCE_MAX_STRUCT_SIZE (nothing written). */
FCE_API fce_status_t fce_softmax_options_init(fce_softmax_options_t* options, size_t struct_size);

/**
 * Temperature softmax for sampling: p_j = exp((x_j - max x) / T) / sum_k exp((x_k - max x) / T), with the
 * max of the raw logits taken first and the difference scaled in fp32 (halved first where x - max would
 * overflow), so no finite input gives NaN at any T > 0 and logits near +-FLT_MAX keep their true
 * differences at any temperature, +inf included. T = 0 is greedy: one-hot at the argmax (lowest index on
 * ties); log-probabilities are then 0 there and -inf elsewhere. -inf logits get probability 0. A row of
 * all -inf, or with a NaN, gives NaN.
 * @param logits   [N,V] fp32, bf16 or fp16.
 * @param probs    optional [N,V], fp32 or the logits' dtype; may be the logits' memory when the dtypes match.
 * @param logprobs optional [N,V], fp32 or the logits' dtype: log p_j = (x_j - max)/T - log(sum). May not
 *                 overlap probs; may be the logits' memory when probs is NULL and the dtypes match.
 * At least one of probs and logprobs is required.
 * @return FCE_STATUS_SUCCESS or the validation statuses.
 */
FCE_API fce_status_t fce_temp_softmax(fce_handle_t handle, fce_stream_t stream, const DLTensor* logits,
                                      const fce_softmax_options_t* options, DLTensor* probs,
                                      DLTensor* logprobs, void* workspace, size_t workspace_bytes);
/** Workspace bytes fce_temp_softmax needs for these arguments. */
FCE_API fce_status_t fce_temp_softmax_workspace_size(fce_handle_t handle, const DLTensor* logits,
                                                     const fce_softmax_options_t* options,
                                                     const DLTensor* probs, const DLTensor* logprobs,
                                                     size_t* bytes);

/**
 * A vocabulary shard's temperature softmax over NCCL (NCCL mode), one call per rank: the whole rows' lse of
 * logits / T (fce_logsumexp_vp with scale 1/T), then this shard's probabilities and log-probabilities of the
 * whole rows (fce_temp_softmax with the shard and that lse: p_j = exp(x_j / T - lse), padding columns 0 and
 * -inf). The same bits as those calls on one device; no host synchronization; with a caller workspace,
 * capturable in a CUDA graph. Since 0.2.0.
 * @param comm     from fce_comm_create, on the handle's device.
 * @param logits   [N,V] fp32, bf16 or fp16: this rank's columns (may be padded past vocab_total).
 * @param options  required: vocab_start, vocab_total and one finite temperature > 0, the same on every rank
 *                 but vocab_start; temperatures and lse NULL (the call computes the lse).
 * @param probs    optional [N,V], fp32 or the logits' dtype, as for fce_temp_softmax.
 * @param logprobs optional [N,V], as for fce_temp_softmax; at least one of the two.
 * @param lse      optional [N] fp32, or [N, 2] for the pairs: receives the whole rows' lse of logits / T (the
 *                 call's own softmax reads the pairs it keeps in the workspace).
 * @param workspace as everywhere (fce_temp_softmax_vp_workspace_size): every rank's records and the rows'
 *                 pairs.
 * @return FCE_STATUS_SUCCESS, the validation statuses (INVALID_ARGUMENT for NULL comm or options, without
 *         vocab_total, or with options->lse; NOT_IMPLEMENTED for per-row, zero or infinite temperatures;
 *         DEVICE_MISMATCH), COMMUNICATOR_ERROR (the all-gather failed), CUDA_ERROR.
 */
FCE_API fce_status_t fce_temp_softmax_vp(fce_handle_t handle, fce_comm_t comm, fce_stream_t stream,
                                         const DLTensor* logits, const fce_softmax_options_t* options,
                                         DLTensor* probs, DLTensor* logprobs, DLTensor* lse, void* workspace,
                                         size_t workspace_bytes);
/** Workspace bytes fce_temp_softmax_vp needs for these arguments (same validation). */
FCE_API fce_status_t fce_temp_softmax_vp_workspace_size(fce_handle_t handle, fce_comm_t comm,
                                                        const DLTensor* logits,
                                                        const fce_softmax_options_t* options,
                                                        const DLTensor* probs, const DLTensor* logprobs,
                                                        const DLTensor* lse, size_t* bytes);

/* ------------------------------------------------------------------------------------------------ */
/* Knowledge distillation                                                                           */
/* ------------------------------------------------------------------------------------------------ */

/** Domain of fce_kd_options_t.temperature, inclusive; other temperatures are FCE_STATUS_INVALID_ARGUMENT.
 *  A divergence over z = logits/T shrinks like 1/T^2 while its fp32 rounding error (~1e-7 nats) does not,
 *  so beyond FCE_KD_TEMPERATURE_MAX the result (and T^2 times it) would be mostly rounding; below
 *  FCE_KD_TEMPERATURE_MIN logits/T and T^2 leave fp32's range for ordinary logits. */
#define FCE_KD_TEMPERATURE_MIN 1e-4f
/** Upper end of the KD temperature domain (see FCE_KD_TEMPERATURE_MIN). */
#define FCE_KD_TEMPERATURE_MAX 100.0f

/** Divergence of fce_kd_options_t. */
typedef enum fce_kd_divergence {
  FCE_KD_FORWARD_KL = 0, /**< KL(P_teacher || P_student) (Hinton et al. 2015) */
  FCE_KD_REVERSE_KL = 1, /**< KL(P_student || P_teacher) */
  /** Generalized JSD (GKD, Agarwal et al. 2024; Liger's convention): with M = b*P_t + (1-b)*P_s,
   *  b*KL(P_t||M) + (1-b)*KL(P_s||M); b = 0 is exactly forward KL and b = 1 exactly reverse KL. */
  FCE_KD_JSD = 2
} fce_kd_divergence_t;

/** How a top-K teacher's student side is normalized. */
typedef enum fce_kd_topk_norm {
  /** Student log-probs over the full vocabulary (its lse over all V), gradient over the full row. */
  FCE_KD_TOPK_FULL_VOCAB = 0,
  /** Student log-probs renormalized over the K ids only; gradient zero outside the K. */
  FCE_KD_TOPK_RENORMALIZE = 1
} fce_kd_topk_norm_t;

/**
 * Options of fce_kd_loss. Initialize with FCE_KD_OPTIONS_INIT.
 * With temperature T both distributions are softmax(logits / T); with a top-K teacher the teacher's
 * distribution over its K ids is softmax_K(logprobs / T) (always renormalized over the K).
 * Terms of zero probability contribute exactly 0, so -inf logits never produce NaN. Log-probabilities are
 * formed from max-shifted values ((x/T - max) - log sum), so adding a constant to a row's logits changes no
 * result beyond rounding of the inputs themselves. Reverse KL (or JSD at beta = 1) where the teacher has
 * probability 0 and the student does not is +inf; dstudent is then the limit of the gradient as those
 * teacher logits go to -inf: +inf at such columns, -inf at the student's other columns of non-zero
 * probability, 0 where the student's probability is 0, each times the sign of the upstream gradient
 * (0 when it is 0).
 */
typedef struct fce_kd_options {
  uint32_t struct_size;     /**< sizeof(fce_kd_options_t) */
  int32_t divergence;       /**< fce_kd_divergence_t; default FCE_KD_FORWARD_KL */
  float beta;               /**< b in [0, 1] for FCE_KD_JSD; default 0.5 */
  float temperature;        /**< T in [FCE_KD_TEMPERATURE_MIN, FCE_KD_TEMPERATURE_MAX]; default 1 */
  int32_t scale_by_t2;      /**< non-zero: multiply loss and gradient by T^2 (Hinton); default 0 */
  int32_t topk_norm;        /**< fce_kd_topk_norm_t; default FCE_KD_TOPK_FULL_VOCAB */
  int32_t reduction;        /**< fce_reduction_t; MEAN = batchmean over unmasked rows; default MEAN */
  int64_t ignore_index;     /**< rows whose target equals this are masked (when targets given); -100 */
  /** A shard of the vocabulary (since 0.2.0; the vocabulary-parallel calls below): the global index of the
   *  shard's first column; default 0. */
  int64_t vocab_start;
  /** The whole vocabulary's size, 0 (default) when the logits are not a shard. fce_kd_loss refuses a shard. */
  int64_t vocab_total;
} fce_kd_options_t;

/** Initializer of fce_kd_options_t: struct_size and every default. */
#define FCE_KD_OPTIONS_INIT \
  { (uint32_t)sizeof(fce_kd_options_t), FCE_KD_FORWARD_KL, 0.5f, 1.0f, 0, FCE_KD_TOPK_FULL_VOCAB, \
    FCE_REDUCTION_MEAN, -100, 0, 0 }

/** Fills the struct_size bytes at `options` with this library's defaults, for callers that cannot use
 *  FCE_KD_OPTIONS_INIT (FFI): the fields it knows get the macro's values, bytes past them are zeroed, and
 *  options->struct_size is set to `struct_size`. Pass sizeof(fce_kd_options_t) as your header defines it.
 *  @return FCE_STATUS_SUCCESS; FCE_STATUS_INVALID_ARGUMENT when options is NULL or struct_size is below
 *  the struct's first published size or above FCE_MAX_STRUCT_SIZE (nothing written). */
FCE_API fce_status_t fce_kd_options_init(fce_kd_options_t* options, size_t struct_size);

/**
 * The teacher: either full logits, or top-K ids and log-probabilities (the axolotl format). Exactly one
 * of `logits` and the (`topk_ids`, `topk_logprobs`) pair is set. Initialize with FCE_KD_TEACHER_INIT.
 */
typedef struct fce_kd_teacher {
  uint32_t struct_size;           /**< sizeof(fce_kd_teacher_t) */
  const DLTensor* logits;         /**< [N,V] fp32, bf16 or fp16 (may differ from the student's dtype) */
  /** [N,K] int32 or int64, K >= 1. A negative id marks an unused slot (contributes nothing; a row with no
   *  used slot is masked). An id >= V makes that row's loss NaN. Ids of a row must be distinct. */
  const DLTensor* topk_ids;
  const DLTensor* topk_logprobs;  /**< [N,K] fp32 teacher log-probabilities at temperature 1 */
} fce_kd_teacher_t;

/** Initializer of fce_kd_teacher_t: struct_size and every default. */
#define FCE_KD_TEACHER_INIT { (uint32_t)sizeof(fce_kd_teacher_t), NULL, NULL, NULL }

/** Fills the struct_size bytes at `teacher` with this library's defaults, for callers that cannot use
 *  FCE_KD_TEACHER_INIT (FFI): the fields it knows get the macro's values, bytes past them are zeroed, and
 *  teacher->struct_size is set to `struct_size`. Pass sizeof(fce_kd_teacher_t) as your header defines it.
 *  @return FCE_STATUS_SUCCESS; FCE_STATUS_INVALID_ARGUMENT when teacher is NULL or struct_size is below
 *  the struct's first published size or above FCE_MAX_STRUCT_SIZE (nothing written). */
FCE_API fce_status_t fce_kd_teacher_init(fce_kd_teacher_t* teacher, size_t struct_size);

/** Outputs of fce_kd_loss. Initialize with FCE_KD_OUTPUTS_INIT. */
typedef struct fce_kd_outputs {
  uint32_t struct_size; /**< sizeof(fce_kd_outputs_t) */
  DLTensor* loss;       /**< required: fp32 [N] (NONE, 0 for masked rows) or scalar; nats */
  /** Optional [N,V] in the student's dtype: d(loss)/d(student logits) * grad_loss, fp32 then rounded once;
   *  may be the student's memory (in-place). */
  DLTensor* dstudent;
  const DLTensor* grad_loss; /**< upstream gradient as in fce_ce_outputs_t; NULL = 1 */
} fce_kd_outputs_t;

/** Initializer of fce_kd_outputs_t: struct_size and every default. */
#define FCE_KD_OUTPUTS_INIT { (uint32_t)sizeof(fce_kd_outputs_t), NULL, NULL, NULL }

/** Fills the struct_size bytes at `outputs` with this library's defaults, for callers that cannot use
 *  FCE_KD_OUTPUTS_INIT (FFI): the fields it knows get the macro's values, bytes past them are zeroed, and
 *  outputs->struct_size is set to `struct_size`. Pass sizeof(fce_kd_outputs_t) as your header defines it.
 *  @return FCE_STATUS_SUCCESS; FCE_STATUS_INVALID_ARGUMENT when outputs is NULL or struct_size is below
 *  the struct's first published size or above FCE_MAX_STRUCT_SIZE (nothing written). */
FCE_API fce_status_t fce_kd_outputs_init(fce_kd_outputs_t* outputs, size_t struct_size);

/**
 * Knowledge-distillation divergence between student and teacher distributions, per row, reduced.
 * @param student [N,V] fp32, bf16 or fp16.
 * @param teacher full logits [N,V] or top-K data, see fce_kd_teacher_t.
 * @param targets optional [N] int32/int64; rows with targets == ignore_index are masked (loss 0, gradient 0).
 * @return FCE_STATUS_SUCCESS or the validation statuses.
 */
FCE_API fce_status_t fce_kd_loss(fce_handle_t handle, fce_stream_t stream, const DLTensor* student,
                                 const fce_kd_teacher_t* teacher, const DLTensor* targets,
                                 const fce_kd_options_t* options, const fce_kd_outputs_t* outputs,
                                 void* workspace, size_t workspace_bytes);
/** Workspace bytes fce_kd_loss needs for these arguments. */
FCE_API fce_status_t fce_kd_loss_workspace_size(fce_handle_t handle, const DLTensor* student,
                                                const fce_kd_teacher_t* teacher, const DLTensor* targets,
                                                const fce_kd_options_t* options,
                                                const fce_kd_outputs_t* outputs, size_t* bytes);

/* Vocabulary-parallel knowledge distillation ------------------------------------------------------ */
/*
 * Student and teacher logits split across W ranks by the same columns (options->vocab_start and
 * vocab_total as for cross-entropy; uneven and padded shards allowed), with the teacher's logits split the
 * same way, or a top-K teacher ([N, K] global ids and log-probabilities, the same on every rank). Forward and
 * reverse KL with teacher logits take one exchange:
 *   1. each rank: fce_kd_partial -> records [N, FCE_KD_RECORD_FIELDS] fp32 of its shard;
 *   2. the caller gathers every rank's records in rank order ([W, N, K], one all-gather);
 *   3. each rank: fce_kd_combine -> the loss of the whole rows (what fce_kd_loss returns) and the rows'
 *      statistics [N, FCE_KD_ROW_STATS_FIELDS] for the gradient, the same bits on every rank;
 *   4. each rank: fce_kd_bwd -> its shard's dstudent.
 * JSD (0 < beta < 1; beta 0 and 1 are exactly forward and reverse KL and take the steps above) and a top-K
 * teacher take two: JSD's mixture M = beta*P_t + (1-beta)*P_s, and a top-K teacher's terms at its K ids, need
 * the rows' normalizers before any term can be formed.
 *   3. each rank: fce_kd_combine with loss = NULL -> the rows' statistics, A (field 4) not yet valid;
 *   3a. each rank: fce_kd_terms_partial -> records [N, FCE_KD_TERMS_RECORD_FIELDS] of its shard: the sums over
 *       its columns (a top-K teacher: its ids in the shard) of the element terms of the divergence and of a_j
 *       (as fce_kd_loss forms them);
 *   3b. the caller gathers those in rank order ([W, N, FCE_KD_TERMS_RECORD_FIELDS], a second all-gather);
 *   3c. each rank: fce_kd_terms_combine -> the loss, and A into the rows' statistics;
 *   4. each rank: fce_kd_bwd as above.
 * Steps 3a-3c work for every divergence (for KL with teacher logits they give its loss a second way).
 * With z = logits / T, P the divergence's weighting distribution (the teacher for forward KL, the student
 * for reverse KL) and Q the other, a record holds, over the shard's real columns: 0 m_P = max z_P,
 * 1 sum exp(z_P - m_P), 2 m_Q, 3 sum exp(z_Q - m_Q), 4 X = sum exp(z_P - m_P) ((z_P - m_P) - (z_Q - m_Q)),
 * terms of zero probability under P adding 0, and 5-6 the shard's column range [vocab_start, end) (int32
 * bits, as cross-entropy's records; since 0.2.0). Both combines check that the ranges tile [0, vocab_total)
 * in rank order: otherwise every row's loss (masked rows included) and statistics are NaN, never a plausible
 * number; a shard of padding alone (vocab_start = vocab_total) is neutral. The combine shifts each record to the row's maxima M and
 * merges them in rank order in fp64: KL(P || Q) = X / D_P - log D_P + log D_Q (identical distributions give
 * exactly 0; a column where P > 0 and Q = 0 gives +inf; NaN propagates; a row without a finite logit in
 * either distribution gives NaN, as fce_kd_loss does). Row statistics: 0 M_student, 1 log D_student,
 * 2 M_teacher, 3 log D_teacher (the row's log-probabilities are (z - M) - log D), 4 A = sum_j a_j of the
 * gradient dL/dz_j = a_j - q_j A (forward KL: -1; reverse KL: KL + 1; the element terms of fce_kd_loss).
 * A top-K teacher's record holds the student's max and sum over the shard's real columns (Q's fields for
 * forward KL and JSD, P's for reverse KL) and those of the student's columns at the teacher's ids in the
 * shard (the other pair: FCE_KD_TOPK_RENORMALIZE's normalizer), X NaN; its row statistics 2 and 3 are then
 * the selected columns' M and log D. The teacher's distribution is softmax_K(topk_logprobs / T) over the used
 * slots, formed by every rank from its own copy. An id >= vocab_total makes the row NaN; a row without a used
 * slot is masked (loss 0, not counted by the mean, gradient 0).
 * The terms' records hold 0 sum L_j and 1 sum a_j over the shard's real columns (a top-K teacher: its slots
 * whose ids fall in the shard) in fp32 from the shard's sum (fp64 on the CPU), L_j and a_j the element terms
 * of fce_kd_loss from the row's log-probabilities above, 2 the number of those slots (-1 with teacher
 * logits), 3-4 the column range; the terms' combine adds them in rank order in fp64: loss = sum L_j (times T^2 with scale_by_t2),
 * A = sum a_j (for KL with teacher logits, A as fce_kd_combine forms it: -1, or KL + 1). For JSD,
 * dL/dz_j = (1 - beta) q_j (log(q_j / m_j) - sum_k q_k log(q_k / m_k)).
 * Against fce_kd_loss of the whole rows: masked rows, all-masked means, NaN and +inf losses and identical
 * distributions (exactly 0) as it gives them; the loss and dstudent within the fp32 rounding of the records'
 * sums (docs/numerics.md).
 */

/** Fields of a knowledge-distillation record (fce_kd_partial; 5 in 0.1.0). */
#define FCE_KD_RECORD_FIELDS 7
/** Fields of a row's knowledge-distillation statistics (fce_kd_combine, fce_kd_bwd). */
#define FCE_KD_ROW_STATS_FIELDS 5
/** Fields of a record of the divergence's terms (fce_kd_terms_partial; since 0.2.0). */
#define FCE_KD_TERMS_RECORD_FIELDS 5

/**
 * The records of a vocabulary shard of student and teacher.
 * @param student [N,V] fp32, bf16 or fp16: the shard's columns (V >= 1, may be padded past vocab_total).
 * @param teacher full logits [N,V] (any float dtype), the shard's columns; or a top-K teacher: [N,K] ids
 *                (global vocabulary indices, negative = unused slot) and log-probabilities, the same on
 *                every rank (its loss then comes from the terms: see above).
 * @param options vocab_start and vocab_total required (0 <= vocab_start <= vocab_total <= 2^31 - 1;
 *                vocab_start = vocab_total: a shard of padding alone); any divergence (JSD:
 *                the forward-KL record, P the teacher); temperature and topk_norm as for fce_kd_loss; the
 *                same options on every rank and call.
 * @param records [N, FCE_KD_RECORD_FIELDS] fp32, written.
 * @return FCE_STATUS_SUCCESS; INVALID_ARGUMENT (no shard in the options, options out of domain);
 *         SHAPE_MISMATCH; UNSUPPORTED_DTYPE; UNSUPPORTED_LAYOUT; DEVICE_MISMATCH; CUDA_ERROR.
 */
FCE_API fce_status_t fce_kd_partial(fce_handle_t handle, fce_stream_t stream, const DLTensor* student,
                                    const fce_kd_teacher_t* teacher, const fce_kd_options_t* options,
                                    DLTensor* records);

/**
 * The divergence of whole rows from every shard's records.
 * @param records   [W,N,FCE_KD_RECORD_FIELDS] fp32, contiguous: every rank's records in rank (vocabulary) order.
 * @param targets   optional [N] int32/int64: rows whose target is options->ignore_index are masked (loss 0).
 * @param options   the partial calls' options (vocab_total required; vocab_start is not read).
 * @param loss      fp32: [N] with reduction NONE (0 at masked rows), else a scalar (MEAN: batchmean over
 *                  the unmasked rows); nats, times T^2 with scale_by_t2. May be NULL (then row_stats is
 *                  required); must be NULL for JSD (0 < beta < 1). Records of a top-K teacher give a NaN
 *                  loss: theirs comes from fce_kd_terms_combine.
 * @param row_stats optional [N, FCE_KD_ROW_STATS_FIELDS] fp32: the rows' statistics for fce_kd_bwd (JSD:
 *                  required, and for fce_kd_terms_partial; its A is valid after fce_kd_terms_combine for
 *                  JSD and a top-K teacher).
 * @return FCE_STATUS_SUCCESS or the validation statuses (INVALID_ARGUMENT for a JSD loss, or a call without
 *         row_stats that is JSD's or has no loss either), CUDA_ERROR.
 */
FCE_API fce_status_t fce_kd_combine(fce_handle_t handle, fce_stream_t stream, const DLTensor* records,
                                    const DLTensor* targets, const fce_kd_options_t* options, DLTensor* loss,
                                    DLTensor* row_stats, void* workspace, size_t workspace_bytes);
/** Workspace bytes fce_kd_combine needs for these arguments (same validation). */
FCE_API fce_status_t fce_kd_combine_workspace_size(fce_handle_t handle, const DLTensor* records,
                                                   const DLTensor* targets, const fce_kd_options_t* options,
                                                   const DLTensor* loss, const DLTensor* row_stats, size_t* bytes);

/**
 * The second exchange of JSD and of a top-K teacher (any divergence works): a shard's sums of the element
 * terms, from the rows' statistics (see "Vocabulary-parallel knowledge distillation" above; since 0.2.0).
 * @param student   [N,V] the shard's columns, as given to fce_kd_partial.
 * @param teacher   as given to fce_kd_partial (the shard's logits, or the top-K teacher).
 * @param row_stats [N, FCE_KD_ROW_STATS_FIELDS] fp32 from fce_kd_combine (fields 0-3 read).
 * @param options   the partial call's options.
 * @param records   [N, FCE_KD_TERMS_RECORD_FIELDS] fp32, written: 0 sum_j L_j, 1 sum_j a_j over the shard's
 *                  real columns or top-K slots (+inf where a term is, NaN where a logit or a statistic is, or
 *                  a top-K id is >= vocab_total), 2 the slots (-1 with teacher logits).
 * @return FCE_STATUS_SUCCESS; INVALID_ARGUMENT; SHAPE_MISMATCH; UNSUPPORTED_DTYPE; UNSUPPORTED_LAYOUT;
 *         DEVICE_MISMATCH; CUDA_ERROR.
 */
FCE_API fce_status_t fce_kd_terms_partial(fce_handle_t handle, fce_stream_t stream, const DLTensor* student,
                                          const fce_kd_teacher_t* teacher, const DLTensor* row_stats,
                                          const fce_kd_options_t* options, DLTensor* records);

/**
 * The loss of whole rows from every shard's terms' records, and the rows' A (since 0.2.0).
 * @param records   [W,N,FCE_KD_TERMS_RECORD_FIELDS] fp32, contiguous: every rank's in rank order.
 * @param targets   optional [N] int32/int64, as for fce_kd_combine (masked rows: loss 0; so are a top-K
 *                  teacher's rows without a used slot).
 * @param options   the partial calls' options.
 * @param loss      fp32: [N] with reduction NONE, else a scalar, as fce_kd_combine's; nats.
 * @param row_stats [N, FCE_KD_ROW_STATS_FIELDS] fp32 from fce_kd_combine: field 4 (A) written, the rest kept.
 * @return FCE_STATUS_SUCCESS or the validation statuses (INVALID_ARGUMENT when row_stats is NULL), CUDA_ERROR.
 */
FCE_API fce_status_t fce_kd_terms_combine(fce_handle_t handle, fce_stream_t stream, const DLTensor* records,
                                          const DLTensor* targets, const fce_kd_options_t* options, DLTensor* loss,
                                          DLTensor* row_stats, void* workspace, size_t workspace_bytes);
/** Workspace bytes fce_kd_terms_combine needs for these arguments (same validation). */
FCE_API fce_status_t fce_kd_terms_combine_workspace_size(fce_handle_t handle, const DLTensor* records,
                                                         const DLTensor* targets, const fce_kd_options_t* options,
                                                         const DLTensor* loss, const DLTensor* row_stats,
                                                         size_t* bytes);

/**
 * A shard's dstudent from the rows' statistics: d(loss)/d(student logits) * grad_loss for the shard's columns
 * (fp32, rounded once; 0 at masked rows and padding columns).
 * @param student   [N,V] the shard's columns, as given to fce_kd_partial.
 * @param teacher   as given to fce_kd_partial (the shard's logits, or the top-K teacher: then, as
 *                  fce_kd_loss, -q_j A over the shard with FCE_KD_TOPK_FULL_VOCAB, 0 with RENORMALIZE, and
 *                  a_k - q_k A at the ids in the shard).
 * @param targets   optional [N], as given to fce_kd_combine (the mean counts the same rows).
 * @param row_stats [N, FCE_KD_ROW_STATS_FIELDS] fp32 from fce_kd_combine (JSD and a top-K teacher: after
 *                  fce_kd_terms_combine).
 * @param options   the partial call's options (vocab_start and vocab_total of this shard).
 * @param grad_loss optional fp32 upstream gradient: a scalar, or [N] with reduction NONE; NULL = 1.
 * @param dstudent  [N,V] in the student's dtype; may be the student's memory (in place).
 * @return FCE_STATUS_SUCCESS or the validation statuses; NOT_IMPLEMENTED on CUDA for a top-K teacher of
 *         K > 8192; CUDA_ERROR.
 */
FCE_API fce_status_t fce_kd_bwd(fce_handle_t handle, fce_stream_t stream, const DLTensor* student,
                                const fce_kd_teacher_t* teacher, const DLTensor* targets,
                                const DLTensor* row_stats, const fce_kd_options_t* options,
                                const DLTensor* grad_loss, DLTensor* dstudent, void* workspace,
                                size_t workspace_bytes);
/** Workspace bytes fce_kd_bwd needs for these arguments (same validation). */
FCE_API fce_status_t fce_kd_bwd_workspace_size(fce_handle_t handle, const DLTensor* student,
                                               const fce_kd_teacher_t* teacher, const DLTensor* targets,
                                               const DLTensor* row_stats, const fce_kd_options_t* options,
                                               const DLTensor* grad_loss, const DLTensor* dstudent,
                                               size_t* bytes);

/**
 * Vocabulary-parallel knowledge distillation in NCCL mode (see "NCCL mode" above; since 0.2.0): one call runs
 * the steps of "Vocabulary-parallel knowledge distillation" on this rank's shard: fce_kd_partial, the
 * all-gather of the records over `comm` on `stream`, fce_kd_combine, for JSD (0 < beta < 1) and a top-K
 * teacher fce_kd_terms_partial, a second all-gather and fce_kd_terms_combine, then with outputs->dstudent
 * fce_kd_bwd. No host synchronization; capturable in a CUDA graph. Every rank calls it with the same N,
 * options (but its own vocab_start) and outputs; the loss is the same bits on every rank and those of the
 * one-device emulation of the same shards.
 * @param comm     from fce_comm_create on this handle's device (a CUDA handle).
 * @param student  [N,V] this rank's shard, as for fce_kd_partial.
 * @param teacher  as for fce_kd_partial: this rank's shard of the teacher's logits, or a top-K teacher.
 * @param targets  optional [N] int32/int64: rows whose target is options->ignore_index are masked.
 * @param options  vocab_start (this rank's) and vocab_total required; any divergence and temperature.
 * @param outputs  loss required (as fce_kd_combine's); dstudent optional (this shard's, in place allowed, with
 *                 grad_loss as for fce_kd_bwd).
 * @param row_stats optional [N, FCE_KD_ROW_STATS_FIELDS] fp32: receives the rows' final statistics, what
 *                 fce_kd_bwd takes for this shard's dstudent later (an autograd backward); the same bits on
 *                 every rank.
 * @param workspace NULL (the handle's cached one), or at least the bytes of fce_kd_fwd_vp_workspace_size.
 * @return FCE_STATUS_SUCCESS, the validation statuses (INVALID_ARGUMENT for a CPU handle or a NULL comm;
 *         DEVICE_MISMATCH for a comm on another device), NOT_IMPLEMENTED (a top-K teacher of K > 8192 with
 *         dstudent), COMMUNICATOR_ERROR, CUDA_ERROR.
 */
FCE_API fce_status_t fce_kd_fwd_vp(fce_handle_t handle, fce_comm_t comm, fce_stream_t stream, const DLTensor* student,
                                   const fce_kd_teacher_t* teacher, const DLTensor* targets,
                                   const fce_kd_options_t* options, const fce_kd_outputs_t* outputs,
                                   DLTensor* row_stats, void* workspace, size_t workspace_bytes);
/** Workspace bytes fce_kd_fwd_vp needs for these arguments (same validation). */
FCE_API fce_status_t fce_kd_fwd_vp_workspace_size(fce_handle_t handle, fce_comm_t comm, const DLTensor* student,
                                                  const fce_kd_teacher_t* teacher, const DLTensor* targets,
                                                  const fce_kd_options_t* options, const fce_kd_outputs_t* outputs,
                                                  const DLTensor* row_stats, size_t* bytes);

/* ------------------------------------------------------------------------------------------------ */
/* Linear cross-entropy                                                                             */
/* ------------------------------------------------------------------------------------------------ */

/**
 * Outputs of linear cross-entropy. Initialize with FCE_LINEAR_CE_OUTPUTS_INIT. Gradients are written
 * (added into with FCE_LINEAR_CE_ACCUMULATE), each formed with fp32 accumulation. dhidden and dbias are rounded once to their
 * dtype, and so is dweight on the CPU and whenever it is fp32. On CUDA a bf16/fp16 dweight is accumulated
 * over the token chunks in its own dtype by the GEMM's fp32 compute, so it is rounded once per chunk
 * (ceil(N / C) chunks of C tokens; the default workspace holds about 448 MiB / (V * 2 bytes) tokens): no
 * fp32 copy of [V,H] is held. Measured against float64 at N = 8192..16384, V = 128256..256000 (4 to 10
 * chunks): within 1.11x the RMS error and 1.35x the max error of one fp32-accumulated GEMM over all N.
 */
typedef struct fce_linear_ce_outputs {
  uint32_t struct_size; /**< sizeof(fce_linear_ce_outputs_t) */
  DLTensor* loss;       /**< required; as fce_ce_outputs_t.loss */
  DLTensor* lse;        /**< optional [N] fp32, or its pairs [N, 2] (fce_ce_outputs_t.lse): save it for
                             fce_linear_cross_entropy_bwd */
  DLTensor* z_loss;     /**< optional; as fce_ce_outputs_t.z_loss */
  DLTensor* argmax;     /**< optional [N] int32/int64 */
  DLTensor* entropy;    /**< optional [N] fp32 */
  DLTensor* dhidden;    /**< optional [N,H], fp32/bf16/fp16 */
  DLTensor* dweight;    /**< optional [V,H], fp32/bf16/fp16 */
  DLTensor* dbias;      /**< optional [V], fp32/bf16/fp16; only with a bias */
  const DLTensor* grad_loss; /**< upstream gradient as in fce_ce_outputs_t; NULL = 1 */
  /** FCE_LINEAR_CE_* bits; default 0. Other bits are FCE_STATUS_INVALID_ARGUMENT. (Since 0.2.0: a
   *  struct_size of an older header, which ends before this field, means 0.) */
  uint64_t flags;
  /* Since 0.2.0. */
  /** Upstream gradient of the entropy (fce_ce_outputs_t.grad_entropy), [N] or a scalar fp32; NULL = none.
   *  Only with a gradient output (dhidden, dweight or dbias). */
  const DLTensor* grad_entropy;
  /** fce_linear_cross_entropy_bwd with grad_entropy only: [N] fp32, the forward's entropy output. */
  const DLTensor* saved_entropy;
} fce_linear_ce_outputs_t;

/** fce_linear_ce_outputs_t.flags: add the gradients into dhidden, dweight and dbias instead of overwriting
 *  them (gradient accumulation across micro-batches; an fp32 dweight as Megatron's main_grad). The sum is
 *  formed in fp32 and rounded as the output's own gradient is (a bf16/fp16 dweight on CUDA once per token
 *  chunk, the first chunk adding into the current values). The outputs are then read as well as written. */
#define FCE_LINEAR_CE_ACCUMULATE 1u

/** Initializer of fce_linear_ce_outputs_t: struct_size and every default. */
#define FCE_LINEAR_CE_OUTPUTS_INIT \
  { (uint32_t)sizeof(fce_linear_ce_outputs_t), NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, 0, NULL, NULL }

/** Fills the struct_size bytes at `outputs` with this library's defaults, for callers that cannot use
 *  FCE_LINEAR_CE_OUTPUTS_INIT (FFI): the fields it knows get the macro's values, bytes past them are
 *  zeroed, and outputs->struct_size is set to `struct_size`. Pass sizeof(fce_linear_ce_outputs_t) as your
 *  header defines it. @return FCE_STATUS_SUCCESS; FCE_STATUS_INVALID_ARGUMENT when outputs is NULL or
 *  struct_size is below the struct's first published size or above FCE_MAX_STRUCT_SIZE (nothing written). */
FCE_API fce_status_t fce_linear_ce_outputs_init(fce_linear_ce_outputs_t* outputs, size_t struct_size);

/**
 * Linear cross-entropy: logits = hidden @ weight^T (+ bias), then cross-entropy with every option of
 * fce_ce_options_t, in token chunks of the default workspace's plan (shorter only when a caller's workspace
 * is smaller), never holding [N,V] logits.
 * The logits are accumulated in fp32 and rounded once to the inputs' dtype, as torch.nn.functional.linear
 * returns them; the cross-entropy statistics are then fp32, and the logits' gradient is likewise rounded to
 * the inputs' dtype before the gradient GEMMs (fp32 accumulation). fp32 inputs stay fp32 throughout.
 * Gradients requested in `outputs` are computed in the same call (6*N*H*V flops); forward only is
 * 2*N*H*V. GEMMs go through cuBLAS and cuBLASLt on the GPU (fp32 accumulation, no split-K) and BLIS
 * (linked into the library) on the CPU, each cut into tiles fixed by the shapes, one single-threaded BLIS
 * call per tile: no result depends on a thread count or on another BLAS in the process. One exception (since 0.2.0): the forward alone on a compute capability 9.0 GPU
 * (H100, H200) with bf16 inputs and no bias, asking for loss, lse and z_loss only (no argmax, entropy or
 * gradient; softcap 0, logit_scale 1; label smoothing only without class weights), runs one fused GEMM of
 * the library's own (CUTLASS, where the build had its headers: fce_build_info's cuda_architectures then lists
 * sm_90a) that never writes the logits. Each 256-column tile of the logits, rounded to bf16 as above, gives
 * a row its max, sum of exp, sum and the target's logit, merged per row in a fixed order (fp64), as the
 * vocabulary-parallel combine merges shards. Same bits run to run, whatever the workspace; not the chunked
 * path's bits (another GEMM's summation order, another merge), within fp32 rounding of the same statistics.
 * @param hidden  [N,H] fp32, bf16 or fp16.
 * @param weight  [V,H], same dtype as hidden.
 * @param bias    optional [V], same dtype as hidden.
 * @param targets [N] int32 or int64.
 * @return FCE_STATUS_SUCCESS, the validation statuses, BLAS_ERROR, CUDA_ERROR, NOT_IMPLEMENTED.
 */
FCE_API fce_status_t fce_linear_cross_entropy_fwd(fce_handle_t handle, fce_stream_t stream,
                                                  const DLTensor* hidden, const DLTensor* weight,
                                                  const DLTensor* bias, const DLTensor* targets,
                                                  const fce_ce_options_t* options,
                                                  const fce_linear_ce_outputs_t* outputs, void* workspace,
                                                  size_t workspace_bytes);
/** Workspace bytes fce_linear_cross_entropy_fwd uses by default: on CUDA at most about 448 MiB (token
 *  chunks as long as fit, in equal parts), on the CPU a 256-token chunk in fp32, dhidden's slice buffers
 *  (up to 15 x 256 x H fp32 with gradients) and fp32 copies of a bf16/fp16 weight and dweight. A caller's workspace may be smaller, down to that of one-token chunks for the same
 *  N (not this query at N = 1: a reduced loss also keeps two fp32 values per row);
 *  FCE_STATUS_WORKSPACE_TOO_SMALL's message states the bytes needed. A larger workspace changes nothing:
 *  the chunks (which decide the bits of dweight's sum over them) are the default plan's whatever the
 *  workspace's size, so a call's results do not depend on it nor on the handle's cached workspace. */
FCE_API fce_status_t fce_linear_cross_entropy_fwd_workspace_size(
    fce_handle_t handle, const DLTensor* hidden, const DLTensor* weight, const DLTensor* bias,
    const DLTensor* targets, const fce_ce_options_t* options, const fce_linear_ce_outputs_t* outputs,
    size_t* bytes);

/**
 * Linear cross-entropy backward from a saved lse: recomputes each chunk's logits and writes the gradients
 * requested in `outputs` (dhidden, dweight, dbias; loss/lse/z_loss/argmax/entropy must be NULL here).
 * With a vocabulary shard in the options (vocab_total set; "Vocabulary-parallel linear cross-entropy"
 * below), weight and bias are the shard's rows, lse (and saved_entropy) the whole rows' from
 * fce_cross_entropy_combine, dweight and dbias the shard's, and dhidden must be fp32: this shard's part of
 * the sum over ranks.
 * @param lse       [N] fp32, or its pairs [N, 2] (the form whose gradient holds at any offset of the
 *                  logits: fce_ce_outputs_t.lse), from the forward with the same options.
 * `outputs->grad_loss` is the upstream gradient (NULL = 1); `outputs->grad_entropy`, with
 * `outputs->saved_entropy` (the forward's entropy), adds the entropy's gradient.
 */
FCE_API fce_status_t fce_linear_cross_entropy_bwd(fce_handle_t handle, fce_stream_t stream,
                                                  const DLTensor* hidden, const DLTensor* weight,
                                                  const DLTensor* bias, const DLTensor* targets,
                                                  const DLTensor* lse, const fce_ce_options_t* options,
                                                  const fce_linear_ce_outputs_t* outputs, void* workspace,
                                                  size_t workspace_bytes);
/** Workspace bytes fce_linear_cross_entropy_bwd needs (as the forward's query). */
FCE_API fce_status_t fce_linear_cross_entropy_bwd_workspace_size(
    fce_handle_t handle, const DLTensor* hidden, const DLTensor* weight, const DLTensor* bias,
    const DLTensor* targets, const DLTensor* lse, const fce_ce_options_t* options,
    const fce_linear_ce_outputs_t* outputs, size_t* bytes);

/* Vocabulary-parallel linear cross-entropy ---------------------------------------------------------- */
/*
 * The LM head split by rows of the vocabulary (rank r holds weight rows [vocab_start_r, vocab_start_r +
 * V_r), possibly padded past vocab_total; hidden and targets whole on every rank). The logits of a shard
 * are its columns of hidden @ weight^T (+ bias), rounded to the inputs' dtype as in the unsharded call, so
 * the records are cross-entropy records (fce_cross_entropy_partial's) and the combine is
 * fce_cross_entropy_combine:
 *   1. each rank: fce_linear_cross_entropy_partial -> records [N, K] fp32 of its shard's logits;
 *   2. the caller all-gathers the records in rank order ([W, N, K]);
 *   3. each rank: fce_cross_entropy_combine -> loss, lse, z_loss, argmax, entropy of the whole rows;
 *   4. each rank: fce_linear_cross_entropy_bwd with the shard's options and the combined lse -> the
 *      shard's dweight [V_r, H] and dbias (complete: they depend on this shard's columns only), and this
 *      shard's part of dhidden, fp32 [N, H]; the caller sums the W parts in fp32 and rounds once (in rank
 *      order for bits that do not depend on the communicator: an all-reduce adds in its ring's or tree's
 *      order, which beyond two ranks changes with NCCL's algorithm and protocol).
 * This recomputes the shard's logits in step 4 (8*N*H*V_r flops in all). fce_linear_cross_entropy_fwd_vp
 * (NCCL mode) exchanges the records chunk by chunk instead and forms the gradients from the logits it
 * already holds (6*N*H*V_r). Padding rows of the weight (past vocab_total) are never read; their dweight
 * and dbias rows are written 0 (left as they are with FCE_LINEAR_CE_ACCUMULATE).
 */

/**
 * The cross-entropy records of a shard's logits (hidden @ weight^T + bias), in token chunks as
 * fce_linear_cross_entropy_fwd.
 * @param hidden  [N,H] fp32, bf16 or fp16, the whole batch (the same on every rank).
 * @param weight  [V,H] this rank's rows of the weight (V >= 1, possibly padded past vocab_total), hidden's dtype.
 * @param bias    optional [V], this rank's part of the bias, hidden's dtype.
 * @param targets [N] int32 or int64, global indices.
 * @param options vocab_start and vocab_total required; the other options as for the unsharded call.
 * @param records [N,K] fp32, written; K one of FCE_CE_RECORD_FIELDS_* (the entropy and argmax need the
 *                wider records, as for fce_cross_entropy_combine).
 * @param workspace as fce_linear_cross_entropy_fwd's (fce_linear_cross_entropy_partial_workspace_size).
 * @return FCE_STATUS_SUCCESS, the validation statuses (INVALID_ARGUMENT without a shard in the options),
 *         WORKSPACE_TOO_SMALL, BLAS_ERROR, CUDA_ERROR.
 */
FCE_API fce_status_t fce_linear_cross_entropy_partial(fce_handle_t handle, fce_stream_t stream,
                                                      const DLTensor* hidden, const DLTensor* weight,
                                                      const DLTensor* bias, const DLTensor* targets,
                                                      const fce_ce_options_t* options, DLTensor* records,
                                                      void* workspace, size_t workspace_bytes);
/** Workspace bytes fce_linear_cross_entropy_partial uses by default (same validation). */
FCE_API fce_status_t fce_linear_cross_entropy_partial_workspace_size(
    fce_handle_t handle, const DLTensor* hidden, const DLTensor* weight, const DLTensor* bias,
    const DLTensor* targets, const fce_ce_options_t* options, const DLTensor* records, size_t* bytes);

/**
 * Vocabulary-parallel linear cross-entropy over NCCL, one call per rank (CUDA): in each token chunk, the
 * shard's logits (a cuBLAS GEMM), their records, an all-gather of the chunk's records on `stream`, the
 * combine in rank order (every rank gets the same bits, equal to a one-device emulation of the same
 * shards through fce_linear_cross_entropy_partial and fce_cross_entropy_combine), and with gradients the
 * chunk's dlogits from the combined lse, in place, then the dhidden and dweight GEMMs. dhidden is the sum of
 * every rank's part, added in fp32 in rank order at the end of the call and rounded once to its dtype: the
 * same bits on every rank and under any NCCL algorithm or protocol, equal to the emulation's rank-order sum.
 * Two ranks all-reduce (a + b is the rank-order sum); more all-gather every rank's fp32 part, a piece at a
 * time, and each adds them in rank order: (W - 1) * N * H * 4 bytes into each rank.
 * @param comm    from fce_comm_create, on the handle's device.
 * @param hidden, weight, bias, targets as for fce_linear_cross_entropy_partial.
 * @param options vocab_start (this rank's first row) and vocab_total required; the same on every rank
 *                otherwise.
 * @param outputs as for fce_linear_cross_entropy_fwd: loss, lse, z_loss, argmax, entropy of the whole rows;
 *                dhidden [N,H] (any float dtype: the ranks' sum), dweight [V,H] and dbias [V] (this shard's
 *                rows); grad_loss, grad_entropy, flags. Every rank passes the same outputs.
 * @param workspace as everywhere (fce_linear_cross_entropy_fwd_vp_workspace_size; default about 448 MiB):
 *                the chunk's logits, the records of all ranks for a chunk, and an fp32 [N,H] dhidden when
 *                the output is not fp32. Every rank must cut the same token chunks (their records are
 *                exchanged), so NCCL mode plans them from vocab_total / ranks and the default size on every
 *                rank, whatever the shard's width or the workspace given: a workspace below this rank's
 *                query is refused (WORKSPACE_TOO_SMALL), not cut into more chunks.
 * @return FCE_STATUS_SUCCESS, the validation statuses, WORKSPACE_TOO_SMALL, COMMUNICATOR_ERROR (a collective
 *         failed), BLAS_ERROR, CUDA_ERROR.
 */
FCE_API fce_status_t fce_linear_cross_entropy_fwd_vp(fce_handle_t handle, fce_comm_t comm, fce_stream_t stream,
                                                     const DLTensor* hidden, const DLTensor* weight,
                                                     const DLTensor* bias, const DLTensor* targets,
                                                     const fce_ce_options_t* options,
                                                     const fce_linear_ce_outputs_t* outputs, void* workspace,
                                                     size_t workspace_bytes);
/** Workspace bytes fce_linear_cross_entropy_fwd_vp uses by default (same validation). */
FCE_API fce_status_t fce_linear_cross_entropy_fwd_vp_workspace_size(
    fce_handle_t handle, fce_comm_t comm, const DLTensor* hidden, const DLTensor* weight, const DLTensor* bias,
    const DLTensor* targets, const fce_ce_options_t* options, const fce_linear_ce_outputs_t* outputs,
    size_t* bytes);

/* ------------------------------------------------------------------------------------------------ */
/* Upstream gradients after the fact                                                                */
/* ------------------------------------------------------------------------------------------------ */

/**
 * Multiplies the rows of x in place by factors read on the device: x[i, :] *= f_i, each element formed in
 * fp32 and rounded once, with f an fp32 scalar (every row) or [N]. A row whose factor is exactly 1 is
 * neither read nor written (x * 1 is x): this applies an upstream gradient, known only after the forward
 * pass, to a gradient the forward already formed (the fused dlogits of fce_cross_entropy_fwd, the dstudent
 * of fce_kd_loss, linear cross-entropy's dhidden, dweight and dbias), at no memory cost in the usual case
 * of an upstream gradient of 1 and with no host synchronization in any case. A NaN factor gives a NaN row.
 * @param x      [N,V] fp32, bf16 or fp16, unit stride on the last axis, rows may be padded (written
 *               only in its elements).
 * @param factor fp32 scalar (ndim 0 or [1]) or [N]; may not overlap x.
 * @return FCE_STATUS_SUCCESS or the validation statuses (INVALID_ARGUMENT for a NULL handle, x or factor;
 *         SHAPE_MISMATCH; UNSUPPORTED_DTYPE; UNSUPPORTED_LAYOUT; DEVICE_MISMATCH; ALIASING), CUDA_ERROR.
 */
FCE_API fce_status_t fce_scale_rows(fce_handle_t handle, fce_stream_t stream, DLTensor* x, const DLTensor* factor);

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* FUSEDCE_FUSEDCE_H_ */
