/* dmuon's C ABI: what the Python package (python/dmuon, loaded with ctypes) and any other foreign
 * caller needs from the engine, with no C++ types crossing it. Built as the shared library
 * libdmuon_c (src/capi).
 *
 * Conventions: every function that can fail returns 0 on success and a non-zero code otherwise;
 * dmuon_last_error() then holds a one-line message naming what was wrong (per thread; valid until
 * the next failing call on that thread). No function aborts or prints. Strings are UTF-8, NUL-ended.
 * Matrices are row-major and dense (row stride = cols), and every tensor is read and written as consecutive
 * elements from its pointer on. So every tensor argument comes with a contiguity flag: 1 when its memory is
 * dense and row-major (numpy's C_CONTIGUOUS, torch's is_contiguous()), 0 when not (a strided view, a transposed
 * or channels_last array). A call given a 0 fails with DMUON_ERR_INVALID naming the argument ("w[2] is not
 * dense row-major memory ..."), before it touches any data: copy such a tensor to a dense one first (and the
 * result back). Thread safety: a dmuon_ns handle may be used
 * by one thread at a time; the other functions are reentrant. BLAS threads are process-wide: a call
 * that sets them (threads > 0) restores the previous count before it returns.
 */
#ifndef DMUON_DMUON_C_H
#define DMUON_DMUON_C_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* The functions below are the library's only exported symbols (it is built with hidden visibility). */
#if defined(__GNUC__)
#define DMUON_C_API __attribute__((visibility("default")))
#else
#define DMUON_C_API
#endif

/* Bumped whenever a signature below changes; python/dmuon checks it when it loads the library. */
#define DMUON_C_ABI_VERSION 8
DMUON_C_API int dmuon_abi_version(void);

/* Return codes. */
enum {
  DMUON_OK = 0,
  DMUON_ERR_INVALID = 1,     /* bad argument: null pointer, unknown name, non-positive size */
  DMUON_ERR_UNSUPPORTED = 2, /* a device or dtype this build does not support */
  DMUON_ERR_FAILED = 3,      /* the engine failed (non-finite input, unreadable file, ...) */
};

/* Where the data lives. CUDA pointers are device pointers, all on one device (the call finds which from
 * the pointers themselves); the work is ordered in the caller's `stream` (a cudaStream_t; NULL: the legacy
 * default stream) as if queued there: the engine's own stream waits for what the caller queued before the
 * call, and `stream` waits for the engine's work, with events, so the caller's allocator may reuse the
 * arguments' memory in `stream`'s order (PyTorch's caching allocator does). dmuon_adamw_step returns without
 * waiting for the device; dmuon_ns_run waits for its inputs' norms (it reports a non-finite input as an
 * error), so the host waits for what the caller queued before it, unless the handle's finite check is off
 * (dmuon_ns_set_check_finite): then it returns without waiting too. A call leaves the thread's current CUDA
 * device as it found it. */
typedef enum { DMUON_DEVICE_CPU = 0, DMUON_DEVICE_CUDA = 1 } dmuon_device;
/* Storage type of the data passed to dmuon_ns_run and dmuon_adamw_step. bfloat16 data is widened to
 * float32 (exactly), computed on and rounded back once per value (nearest even). The storage type is not
 * Newton-Schulz's compute dtype (its iterates' type, products accumulating in float32): that is the handle's,
 * dmuon_ns_set_dtype. AdamW computes in float32. */
typedef enum { DMUON_DTYPE_F32 = 0, DMUON_DTYPE_BF16 = 1 } dmuon_dtype;

/* The message of the last failing call on this thread ("" when none). */
DMUON_C_API const char* dmuon_last_error(void);

/* Which devices and dtypes this build supports on this machine (1 yes, 0 no), so a caller can say so before
 * it fails: cpu with both dtypes always; cuda with both when the library was built with the CUDA backend and
 * the process sees a CUDA device. */
DMUON_C_API int dmuon_supports(int device, int dtype);
/* 1 where Newton-Schulz calls on the CPU that ask for no compute dtype (a handle without dmuon_ns_set_dtype) run each
 * shape in the faster of bfloat16 and float32 once dmuon_tune has timed both there (a CPU with bf16 instructions that
 * oneDNN uses: AVX-512 BF16 or AMX), 0 where float32 alone is tuned (no bf16 instructions, DMUON_NS_DEFAULT_DTYPE=f32).
 * A shape without a tuned entry runs untuned in the CPU's default dtype. */
DMUON_C_API int dmuon_tuning_chooses_dtype(void);

/* ---- Newton–Schulz ---- */

/* An orthogonalizer: the math (coefficient schedule, steps, algorithm) and, when a tuning cache is
 * given, the tuned kernel choice per (shape, batch) from it (as `dmuon tune` writes it).
 *   coeffs:     "keller", "you" or "polar-express"
 *   algo:       "auto" (the tuned choice when the cache has the shape, else gram for aspect ≥ 2),
 *               "standard" or "gram" (forced; the cache is then ignored)
 *   steps:      ≥ 1
 *   threads:    BLAS threads per call (≥ 1); also selects the cache entries (they are keyed by it). The
 *               tuning is the CPU's: on a GPU the handle runs its coefficients, steps and algo untuned.
 *   tune_cache: path of a tuning cache, "" for the default path (dmuon_default_tune_cache_path), or
 *               NULL for none. A missing file means no tuned entries; a corrupt or foreign one too,
 *               and dmuon_ns_warning says why.
 * *out receives the handle; release it with dmuon_ns_destroy. */
typedef struct dmuon_ns dmuon_ns;
DMUON_C_API int dmuon_ns_create(const char* coeffs, const char* algo, int steps, int threads, const char* tune_cache,
                    dmuon_ns** out);
DMUON_C_API void dmuon_ns_destroy(dmuon_ns* ns);
/* Number of tuned entries the handle uses, and why a given cache was rejected ("" when it was not). */
DMUON_C_API int64_t dmuon_ns_tuned_entries(const dmuon_ns* ns);
DMUON_C_API const char* dmuon_ns_warning(const dmuon_ns* ns);
/* The compute dtype (*compute, DMUON_DTYPE_*) a dmuon_ns_run of `batch` rows×cols matrices stored as `dtype` on
 * `device` takes with this handle now, and whether a tuned entry gives its kernel (*tuned 1, else 0: untuned):
 * callers that report what ran (benchmarks), or advise tuning. Either pointer may be NULL. */
DMUON_C_API int dmuon_ns_call_dtype(const dmuon_ns* ns, int device, int dtype, int64_t rows, int64_t cols,
                                    int64_t batch, int* compute, int* tuned);
/* check 1 (a new handle's setting): dmuon_ns_run reads its inputs' norms back and fails naming a non-finite
 * input, so on a GPU the host waits for what the caller queued before the call. check 0: the norms stay on the
 * device, the call returns without waiting for it, and a non-finite input gives non-finite outputs: for callers
 * that check their gradients before (dmuon.torch.DMuon does), so one bucket's Newton-Schulz queues behind the
 * previous bucket's communication instead of waiting for it. */
DMUON_C_API int dmuon_ns_set_check_finite(dmuon_ns* ns, int check);
/* Newton-Schulz's compute dtype for this handle's dmuon_ns_run and dmuon_muon_update, chosen by the caller (never
 * inferred from the data's storage type): DMUON_DTYPE_F32, DMUON_DTYPE_BF16 (bfloat16 iterates, float32
 * accumulation, DESIGN 2.2's half-precision restarts; on the CPU it needs oneDNN, else the run fails naming the
 * device), or DMUON_NS_DTYPE_DEFAULT (a new handle's setting): the device's default, on the CPU bfloat16 where it has
 * bf16 matrix units (AMX) and float32 elsewhere (the environment variable DMUON_NS_DEFAULT_DTYPE=bf16|f32
 * forces either), on a GPU the data's storage type (dmuon_muon_update: bfloat16). On the CPU where
 * dmuon_tuning_chooses_dtype (bf16 instructions: AVX-512 BF16 or AMX), a shape the handle's tuning cache has from
 * dmuon_tune instead runs in the faster of bfloat16 and float32 as dmuon_tune measured it (algo "auto"); an asked
 * dtype is never replaced. */
#define DMUON_NS_DTYPE_DEFAULT (-1)
DMUON_C_API int dmuon_ns_set_dtype(dmuon_ns* ns, int dtype);

/* O_i = orth(U_i) for `batch` same-shape rows×cols matrices: in[i] and out[i] point at rows·cols
 * elements of `dtype` on `device` (in[i] may equal out[i]); in_dense[i], out_dense[i] their contiguity flags. `stream` is the CUDA stream for
 * DMUON_DEVICE_CUDA (NULL: the default stream) and must be NULL for the CPU. `names` (NULL or
 * `batch` strings) name the matrices in errors (a non-finite input is an error). Returns
 * DMUON_ERR_UNSUPPORTED naming the device when this build or machine lacks it. A handle keeps the
 * float32 copy of its largest bfloat16 batch per device for reuse until it is destroyed. */
DMUON_C_API int dmuon_ns_run(dmuon_ns* ns, int device, int dtype, void* stream, const void* const* in,
                             const int* in_dense, void* const* out, const int* out_dense, int64_t batch, int64_t rows,
                             int64_t cols, const char* const* names);
/* The bytes of every buffer the engine holds now, on every device (its Newton-Schulz workspaces, pooled for reuse
 * between calls, and what calls running allocate), into *live, and the most they came to since the last reset into
 * *peak; reset_peak 1 then starts the peak again from *live. The engine's own memory, which the caller's allocator
 * does not see (the memory table of python/benchmarks/fsdp2_owner_step.py). Either pointer may be NULL. */
DMUON_C_API void dmuon_engine_bytes(uint64_t* live, uint64_t* peak, int reset_peak);
/* Frees the Newton-Schulz workspaces the engine pools between calls (the next call allocates its own again), e.g. so
 * that a benchmark counts each optimizer's own. */
DMUON_C_API void dmuon_release_workspaces(void);

/* ---- Muon's update rule around Newton-Schulz (DESIGN 1) ----
 *
 * For a step that keeps its per-step values on the device (dmuon.torch's: nothing in it waits for the device).
 * Tensors come as n data pointers with n sizes (elements) and n dtype codes (float32 updated in place; bfloat16
 * widened to float32, computed on and rounded back once per value), each array of pointers with an array of n
 * contiguity flags (<name>_dense, see the top of this file); an empty tensor's pointer may be NULL. Two
 * values stay where the step computed them, read by the device and never by the host: keep[i] points at one float32 in the data's memory (0: tensor
 * i's update changes nothing, bit for bit; keep NULL: every tensor is updated) and grad_scale at one float32, the
 * gradients' factor (clipping; NULL: 1). Device and stream as for dmuon_ns_run; none of these calls waits for the
 * device, except dmuon_muon_update with a handle whose finite check is on (dmuon_ns_set_check_finite). Rounding
 * as torch.optim's float32 order: 1-beta and beta rounded from double separately (lerp_'s weights),
 * 1 - lr*weight_decay, -lr and each scale rounded once to float32. */

/* M <- lerp(M, g, 1-beta); U = nesterov ? lerp(g, M, beta) : M, for n tensors, g = grads[i]*grad_scale (grads[i]
 * NULL: a zero gradient); where keep[i] is 0, g is taken as M (so M stays bit for bit and U = M). u[i] may equal
 * grads[i]. */
DMUON_C_API int dmuon_muon_momentum(int device, void* stream, int64_t n, const int64_t* sizes, const void* const* grads,
                                    const int* grad_dtypes, const int* grad_dense, void* const* momenta,
                                    const int* momentum_dtypes, const int* momentum_dense, void* const* u,
                                    const int* u_dtypes, const int* u_dense, const float* const* keep,
                                    const float* grad_scale, double beta, int nesterov);

/* W <- W*(1 - lr*weight_decay) - lr*(O*scales[i]) for n tensors, where keep[i] is not 0. cautious_wd != 0: the
 * decay only where W*O >= 0 (cautious weight decay, arXiv 2510.12402), W as it is elsewhere. */
DMUON_C_API int dmuon_muon_apply(int device, void* stream, int64_t n, const int64_t* sizes, void* const* w,
                                 const int* w_dtypes, const int* w_dense, const void* const* o, const int* o_dtypes,
                                 const int* o_dense, const float* const* keep, double lr, double weight_decay,
                                 const double* scales, int cautious_wd);

/* The whole update of `batch` same-shape rows x cols matrices held here whole (their owner's), in one call: the
 * momentum of dmuon_muon_momentum into a float32 U, O = orth(U) by `ns` (its coefficients, steps and tuned kernel;
 * bfloat16 iterates where the device computes in bfloat16, as dmuon_ns_run on bfloat16 data), then the apply of
 * dmuon_muon_apply with the one `scale` and cautious_wd. names (NULL or `batch` strings) as for dmuon_ns_run. */
DMUON_C_API int dmuon_muon_update(dmuon_ns* ns, int device, void* stream, int64_t batch, int64_t rows, int64_t cols,
                                  const void* const* grads, const int* grad_dtypes, const int* grad_dense,
                                  void* const* momenta, const int* momentum_dtypes, const int* momentum_dense,
                                  void* const* w, const int* w_dtypes, const int* w_dense, const float* const* keep,
                                  const float* grad_scale, double beta, int nesterov, double lr, double weight_decay,
                                  double scale, int cautious_wd, const char* const* names);

/* ---- AdamW ---- */

/* One AdamW step on n elements, the rule of torch.optim.AdamW (bias-corrected, decoupled decay;
 * include/dmuon/optim.hpp adamw_step), in one pass: p ← p·(1 − lr·wd); m ← β1·m + (1−β1)·g;
 * v ← β2·v + (1−β2)·g²; p ← p − lr/(1−β1^step)·m/(sqrt(v)/sqrt(1−β2^step) + eps), with
 * g = grad·grad_scale. p, exp_avg, exp_avg_sq are updated in place; step ≥ 1. Device, dtype and
 * stream as for dmuon_ns_run; all four arrays have the one `dtype` (bfloat16: stepped in float32 and
 * p, exp_avg, exp_avg_sq rounded back once per value; torch.optim.AdamW(fused=True) also computes in
 * float32, its unfused form rounds after every operation). dense: the contiguity flags of p, grad, exp_avg and
 * exp_avg_sq, in that order. */
DMUON_C_API int dmuon_adamw_step(int device, int dtype, void* stream, void* p, const void* grad, void* exp_avg,
                                 void* exp_avg_sq, const int* dense, int64_t n, int64_t step, double lr, double beta1, double beta2,
                                 double eps, double weight_decay, float grad_scale);

/* ---- planning ---- */

/* Owner rank of each of n Muon matrices (rows[i]×cols[i]) on world_size ranks, as dmuon's planner
 * makes it (DESIGN 3.4): balancer "milp", "lpt" or "rr"; costs "flop" (flop counts), "tuned"
 * (the tuning cache's timings for threads BLAS threads of calls that ask for no dtype, dmuon_tune's; an error naming the first missing shape and
 * batch when it lacks one) or "auto" (tuned when the cache has every one, else flop). tune_cache as
 * for dmuon_ns_create. milp is time-limited (time_limit_s) and so is not guaranteed identical on
 * every rank: call it on one rank and broadcast owner_out. *used_tuned (may be NULL) is set to 1 when
 * tuned costs were used. */
DMUON_C_API int dmuon_plan_owners(int64_t n, const int64_t* rows, const int64_t* cols, int world_size, const char* balancer,
                      const char* costs, const char* tune_cache, int threads, double time_limit_s,
                      int32_t* owner_out, int* used_tuned);

/* dmuon_plan_owners with each matrix costed as the blocks its Newton-Schulz runs on (split Newton-Schulz:
 * MuonMatrixOptions::split_heads / split_sizes in C++, dmuon.torch's split_heads / split_sizes per param group).
 * Matrix i has block_counts[i] blocks, whose shapes are the next block_counts[i] entries of block_rows and
 * block_cols (matrix 0's blocks first, then matrix 1's, ...); 0 blocks: the whole rows[i]×cols[i] matrix, as
 * dmuon_plan_owners costs it. A split matrix stays one item with one owner and its bytes are the matrix's; its time
 * is the sum of its blocks' times, each block counted among the matrices and blocks of its shape (include/dmuon/
 * plan.hpp make_plan_items' ns_blocks, the costs `dmuon train` plans with). A matrix's blocks must have its number
 * of elements (an (E, m, n) stack given as one matrix may list its E matrices' blocks). costs "tuned" needs the
 * block shapes tuned (their batch: ceil(blocks and matrices of that shape / world_size)); "auto" falls back to
 * flop costs for every matrix when one is missing. DMUON_ERR_INVALID names the matrix (and block) that is wrong. */
DMUON_C_API int dmuon_plan_owners_blocks(int64_t n, const int64_t* rows, const int64_t* cols,
                                         const int64_t* block_counts, const int64_t* block_rows,
                                         const int64_t* block_cols, int world_size, const char* balancer,
                                         const char* costs, const char* tune_cache, int threads,
                                         double time_limit_s, int32_t* owner_out, int* used_tuned);

/* ---- tuning ---- */

/* Tunes what the cache lacks for the n (rows, cols, batch) requests with `threads` BLAS threads and
 * `rounds` timing rounds per candidate, for calls that ask for no compute dtype (DMUON_NS_DTYPE_DEFAULT on the CPU):
 * where dmuon_tuning_chooses_dtype (AVX-512 BF16 or AMX), bfloat16 and float32 candidates compete and each shape
 * keeps the faster dtype; elsewhere float32 only. Saves the cache when it changed. tune_cache as above
 * (NULL is not allowed here). Takes seconds to minutes: it runs Newton–Schulz many times. */
DMUON_C_API int dmuon_tune(int64_t n, const int64_t* rows, const int64_t* cols, const int32_t* batch, int threads, int rounds,
               const char* tune_cache);

/* Writes the default tuning cache path into buf (cap bytes, NUL-ended). DMUON_ERR_INVALID when
 * it does not fit; *needed (may be NULL) gets its length + 1 either way. */
DMUON_C_API int dmuon_default_tune_cache_path(char* buf, size_t cap, size_t* needed);

/* ---- model shapes ---- */

/* The parameters of a model manifest (models/<name>.json or a path; `layers` > 0 keeps the first
 * layers) as JSON text: [{"name": ..., "shape": [...], "role": "matrix"|"elementwise"}, ...], written
 * into buf as dmuon_default_tune_cache_path does. */
DMUON_C_API int dmuon_model_params_json(const char* name_or_path, int layers, char* buf, size_t cap, size_t* needed);

#ifdef __cplusplus
}
#endif

#endif /* DMUON_DMUON_C_H */
