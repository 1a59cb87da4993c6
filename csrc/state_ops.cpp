// dvllm's state-pool ops: schemas, argument checks and CPU kernels.
//
// The pool is one contiguous [num_blocks, block_numel] tensor. A row's state is a flat
// vector of numel elements, and element i of row r lives at
//   pool[table[r, i / block_numel], i % block_numel]
// where table is an int32 [R, ceil(numel / block_numel)] block table. The pure-torch
// references in dvllm/ops.py define what each op means; tests/test_state_ops.py checks
// these kernels against them.

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>
#include <vector>

// The Coeff enumeration (scatter_update's coefficient columns), generated from dvllm/sampler_coeffs.py by
// dvllm/_extension.py into the build directory.
#include "dvllm_coeffs.h"

namespace dvllm {
namespace {


int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

bool is_pool_dtype(at::ScalarType t) {
  return t == at::kFloat || t == at::kHalf || t == at::kBFloat16;
}

void check_pool(const char* op, const at::Tensor& pool) {
  TORCH_CHECK(pool.dim() == 2, op, ": pool must be 2-D [num_blocks, block_numel], got shape ", pool.sizes());
  TORCH_CHECK(pool.size(1) > 0, op, ": pool blocks must hold at least one element");
  TORCH_CHECK(pool.is_contiguous(), op, ": pool must be contiguous");
  TORCH_CHECK(is_pool_dtype(pool.scalar_type()), op, ": pool must be float32, float16 or bfloat16, got ",
              pool.scalar_type());
}

// A block table for `rows` rows of `numel` elements: int32 [rows, ceil(numel / block_numel)].
void check_table(const char* op, const char* name, const at::Tensor& table, const at::Tensor& pool,
                 int64_t rows, int64_t numel) {
  const int64_t nb = ceil_div(numel, pool.size(1));
  TORCH_CHECK(table.scalar_type() == at::kInt, op, ": ", name, " must be int32, got ", table.scalar_type());
  TORCH_CHECK(table.device() == pool.device(), op, ": ", name, " is on ", table.device(), " but pool is on ",
              pool.device());
  TORCH_CHECK(table.dim() == 2 && table.size(0) == rows && table.size(1) == nb, op, ": ", name,
              " must have shape [", rows, ", ", nb, "] (rows, ceil(", numel, " / ", pool.size(1),
              ")), got ", table.sizes());
  TORCH_CHECK(table.is_contiguous(), op, ": ", name, " must be contiguous");
}

// A dense [rows, numel] tensor on the pool's device, of the pool's dtype (or float32 if allowed).
void check_rows(const char* op, const char* name, const at::Tensor& t, const at::Tensor& pool, int64_t rows,
                int64_t numel, bool allow_float32) {
  TORCH_CHECK(t.dim() == 2 && t.size(0) == rows && t.size(1) == numel, op, ": ", name, " must have shape [",
              rows, ", ", numel, "], got ", t.sizes());
  TORCH_CHECK(t.device() == pool.device(), op, ": ", name, " is on ", t.device(), " but pool is on ",
              pool.device());
  TORCH_CHECK(t.scalar_type() == pool.scalar_type() || (allow_float32 && t.scalar_type() == at::kFloat), op,
              ": ", name, " must be ", allow_float32 ? "float32 or " : "", "the pool's dtype (",
              pool.scalar_type(), "), got ", t.scalar_type());
  TORCH_CHECK(t.is_contiguous(), op, ": ", name, " must be contiguous");
}

// Block ids address raw memory, so the CPU kernels check them all (a cheap pass next to
// the copies). Rows whose first entry is negative are skipped when `allow_disabled_rows`.
void check_block_ids(const char* op, const char* name, const at::Tensor& table, int64_t num_blocks,
                     bool allow_disabled_rows) {
  const int64_t rows = table.size(0), nb = table.size(1);
  const int32_t* ids = table.const_data_ptr<int32_t>();
  for (int64_t r = 0; r < rows; ++r) {
    if (allow_disabled_rows && ids[r * nb] < 0) continue;
    for (int64_t j = 0; j < nb; ++j) {
      const int32_t id = ids[r * nb + j];
      TORCH_CHECK(id >= 0 && id < num_blocks, op, ": ", name, "[", r, ", ", j, "] = ", id,
                  " is not a block of the pool (0 <= id < ", num_blocks, ")");
    }
  }
}

// Runs f(row, col, offset, n) over every block segment of every row, in parallel:
// elements [offset, offset + n) of `row` live in block table[row, col].
template <typename F>
void for_each_segment(int64_t rows, int64_t numel, int64_t block_numel, const F& f) {
  const int64_t nb = ceil_div(numel, block_numel);
  // About 16K elements per task: big enough that scheduling costs little next to the work.
  const int64_t grain = std::max<int64_t>(1, 16384 / block_numel);
  at::parallel_for(0, rows * nb, grain, [&](int64_t begin, int64_t end) {
    for (int64_t s = begin; s < end; ++s) {
      const int64_t row = s / nb, col = s % nb, offset = col * block_numel;
      f(row, col, offset, std::min(block_numel, numel - offset));
    }
  });
}

// The update works on float32 chunks so that its math (and, with F16C, float16
// conversion: see dvllm/_extension.py) is plain loops the compiler vectorizes.
constexpr int64_t kChunk = 256;

template <typename T>
void load_floats(const T* src, int64_t n, float* dst) {
  for (int64_t k = 0; k < n; ++k) dst[k] = static_cast<float>(src[k]);
}

template <typename T>
void store_floats(const float* src, int64_t n, T* dst) {
  for (int64_t k = 0; k < n; ++k) dst[k] = static_cast<T>(src[k]);
}

// A read-only [R, numel] input that is either float32 or the pool's dtype.
template <typename scalar_t>
struct RowsInput {
  const void* data;  // nullptr when the input is absent
  bool is_float;
  void load(int64_t first, int64_t n, float* dst) const {  // elements [first, first + n) of the flat input
    if (is_float) {
      std::memcpy(dst, static_cast<const float*>(data) + first, n * sizeof(float));
    } else {
      load_floats(static_cast<const scalar_t*>(data) + first, n, dst);
    }
  }
};

// clamp(x, -c, c) as torch.maximum(torch.minimum(x, c), -c) computes it: a NaN x stays NaN.
inline float clamp_abs(float x, float c) {
  x = x > c ? c : x;
  return x < -c ? -c : x;
}

}  // namespace

// ---- Argument checks, also called by the CUDA entry points (state_ops_cuda.cu). ----

void check_gather_args(const at::Tensor& out, const at::Tensor& pool, const at::Tensor& block_table) {
  const char* op = "dvllm::gather_blocks";
  check_pool(op, pool);
  TORCH_CHECK(out.dim() == 2, op, ": out must be 2-D [R, numel], got shape ", out.sizes());
  check_rows(op, "out", out, pool, out.size(0), out.size(1), /*allow_float32=*/false);
  check_table(op, "block_table", block_table, pool, out.size(0), out.size(1));
}

void check_scatter_args(const at::Tensor& src, const at::Tensor& pool, const at::Tensor& block_table) {
  const char* op = "dvllm::scatter_blocks";
  check_pool(op, pool);
  TORCH_CHECK(src.dim() == 2, op, ": src must be 2-D [R, numel], got shape ", src.sizes());
  check_rows(op, "src", src, pool, src.size(0), src.size(1), /*allow_float32=*/false);
  check_table(op, "block_table", block_table, pool, src.size(0), src.size(1));
}

void check_update_args(const at::Tensor& pool, const at::Tensor& latent_table, const at::Tensor& model_output,
                       const at::Tensor& coeffs, const std::optional<at::Tensor>& history_table,
                       const std::optional<at::Tensor>& noise) {
  const char* op = "dvllm::scatter_update";
  check_pool(op, pool);
  TORCH_CHECK(model_output.dim() == 2, op, ": model_output must be 2-D [R, numel], got shape ",
              model_output.sizes());
  const int64_t rows = model_output.size(0), numel = model_output.size(1);
  check_rows(op, "model_output", model_output, pool, rows, numel, /*allow_float32=*/true);
  check_table(op, "latent_table", latent_table, pool, rows, numel);
  TORCH_CHECK(coeffs.scalar_type() == at::kFloat, op, ": coeffs must be float32, got ", coeffs.scalar_type());
  TORCH_CHECK(coeffs.dim() == 2 && coeffs.size(0) == rows && coeffs.size(1) == NUM_COEFFS, op,
              ": coeffs must have shape [", rows, ", ", int(NUM_COEFFS), "], got ", coeffs.sizes());
  TORCH_CHECK(coeffs.device() == pool.device(), op, ": coeffs is on ", coeffs.device(), " but pool is on ",
              pool.device());
  TORCH_CHECK(coeffs.is_contiguous(), op, ": coeffs must be contiguous");
  if (history_table) check_table(op, "history_table", *history_table, pool, rows, numel);
  if (noise) check_rows(op, "noise", *noise, pool, rows, numel, /*allow_float32=*/true);
}

// ---- CPU kernels ----

// out[r, i] = pool[block_table[r, i / B], i % B]
void gather_blocks_cpu(at::Tensor& out,                  // [R, numel], pool dtype
                       const at::Tensor& pool,           // [num_blocks, B]
                       const at::Tensor& block_table) {  // [R, ceil(numel / B)] int32
  check_gather_args(out, pool, block_table);
  const int64_t rows = out.size(0), numel = out.size(1), B = pool.size(1), nb = block_table.size(1);
  if (rows == 0 || numel == 0) return;
  check_block_ids("dvllm::gather_blocks", "block_table", block_table, pool.size(0), /*allow_disabled_rows=*/false);
  const int64_t es = pool.element_size();
  const char* src = static_cast<const char*>(pool.const_data_ptr());
  char* dst = static_cast<char*>(out.mutable_data_ptr());
  const int32_t* table = block_table.const_data_ptr<int32_t>();
  // Copying bytes makes the kernel dtype-agnostic: each segment is one contiguous run.
  for_each_segment(rows, numel, B, [&](int64_t r, int64_t col, int64_t offset, int64_t n) {
    std::memcpy(dst + (r * numel + offset) * es, src + static_cast<int64_t>(table[r * nb + col]) * B * es, n * es);
  });
}

// pool[block_table[r, i / B], i % B] = src[r, i]; the rest of the pool is untouched.
void scatter_blocks_cpu(const at::Tensor& src,            // [R, numel], pool dtype
                        at::Tensor& pool,                 // [num_blocks, B]
                        const at::Tensor& block_table) {  // [R, ceil(numel / B)] int32
  check_scatter_args(src, pool, block_table);
  const int64_t rows = src.size(0), numel = src.size(1), B = pool.size(1), nb = block_table.size(1);
  if (rows == 0 || numel == 0) return;
  check_block_ids("dvllm::scatter_blocks", "block_table", block_table, pool.size(0), /*allow_disabled_rows=*/false);
  const int64_t es = pool.element_size();
  const char* from = static_cast<const char*>(src.const_data_ptr());
  char* dst = static_cast<char*>(pool.mutable_data_ptr());
  const int32_t* table = block_table.const_data_ptr<int32_t>();
  for_each_segment(rows, numel, B, [&](int64_t r, int64_t col, int64_t offset, int64_t n) {
    std::memcpy(dst + static_cast<int64_t>(table[r * nb + col]) * B * es, from + (r * numel + offset) * es, n * es);
  });
}

// The fused sampler update (dvllm/ops.py scatter_update_ref), in place in the pool.
void scatter_update_cpu(at::Tensor& pool,                                 // [num_blocks, B]
                        const at::Tensor& latent_table,                   // [R, nb] int32
                        const at::Tensor& model_output,                   // [R, numel] float32 or pool dtype
                        const at::Tensor& coeffs,                         // [R, NUM_COEFFS] float32
                        const std::optional<at::Tensor>& history_table,  // [R, nb] int32, row of -1: none
                        const std::optional<at::Tensor>& noise,          // [R, numel] float32 or pool dtype
                        bool clip) {
  check_update_args(pool, latent_table, model_output, coeffs, history_table, noise);
  const int64_t rows = model_output.size(0), numel = model_output.size(1), B = pool.size(1);
  const int64_t nb = latent_table.size(1);
  if (rows == 0 || numel == 0) return;
  const char* op = "dvllm::scatter_update";
  check_block_ids(op, "latent_table", latent_table, pool.size(0), /*allow_disabled_rows=*/false);
  if (history_table) check_block_ids(op, "history_table", *history_table, pool.size(0), /*allow_disabled_rows=*/true);
  const int32_t* lt = latent_table.const_data_ptr<int32_t>();
  const int32_t* ht = history_table ? history_table->const_data_ptr<int32_t>() : nullptr;
  const float* cf = coeffs.const_data_ptr<float>();

  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, pool.scalar_type(), "scatter_update_cpu", [&] {
    scalar_t* base = pool.mutable_data_ptr<scalar_t>();
    const RowsInput<scalar_t> mo_in{model_output.const_data_ptr(), model_output.scalar_type() == at::kFloat};
    const RowsInput<scalar_t> noise_in{noise ? noise->const_data_ptr() : nullptr,
                                       noise && noise->scalar_type() == at::kFloat};
    for_each_segment(rows, numel, B, [&](int64_t r, int64_t col, int64_t offset, int64_t n) {
      const float* c = cf + r * NUM_COEFFS;
      const float ax = c[AX], am = c[AM], bound = c[CLIP], cs = c[CS], cm = c[CM], cx = c[CX], ch = c[CH], cn = c[CN];
      scalar_t* x_seg = base + static_cast<int64_t>(lt[r * nb + col]) * B;
      scalar_t* h_seg = (ht && ht[r * nb] >= 0) ? base + static_cast<int64_t>(ht[r * nb + col]) * B : nullptr;
      float x[kChunk], mo[kChunk], x0[kChunk], prev[kChunk], extra[kChunk];
      for (int64_t done = 0; done < n; done += kChunk) {
        const int64_t m = std::min(kChunk, n - done);
        const int64_t first = r * numel + offset + done;  // flat index in model_output / noise
        load_floats(x_seg + done, m, x);
        mo_in.load(first, m, mo);
        // The same float32 operations, in the same order, as scatter_update_ref.
        for (int64_t k = 0; k < m; ++k) x0[k] = ax * x[k] + am * mo[k];
        if (clip) {
          for (int64_t k = 0; k < m; ++k) x0[k] = clamp_abs(x0[k], bound);
        }
        for (int64_t k = 0; k < m; ++k) prev[k] = cs * x[k] + cm * mo[k] + cx * x0[k];
        if (h_seg) {  // read the old history, then replace it with x0
          load_floats(h_seg + done, m, extra);
          for (int64_t k = 0; k < m; ++k) prev[k] += ch * extra[k];
          store_floats(x0, m, h_seg + done);
        }
        if (noise_in.data) {
          noise_in.load(first, m, extra);
          for (int64_t k = 0; k < m; ++k) prev[k] += cn * extra[k];
        }
        store_floats(prev, m, x_seg + done);
      }
    });
  });
}

// The coefficient layout this library was compiled with: the names' indices, then NUM_COEFFS.
std::vector<int64_t> coeff_layout() { return DVLLM_COEFF_LAYOUT; }

}  // namespace dvllm

TORCH_LIBRARY(dvllm, m) {
  m.def("coeff_layout() -> int[]", &dvllm::coeff_layout);
  m.def("gather_blocks(Tensor(a!) out, Tensor pool, Tensor block_table) -> ()");
  m.def("scatter_blocks(Tensor src, Tensor(a!) pool, Tensor block_table) -> ()");
  m.def(
      "scatter_update(Tensor(a!) pool, Tensor latent_table, Tensor model_output, Tensor coeffs, "
      "Tensor? history_table, Tensor? noise, bool clip) -> ()");
}

TORCH_LIBRARY_IMPL(dvllm, CPU, m) {
  m.impl("gather_blocks", &dvllm::gather_blocks_cpu);
  m.impl("scatter_blocks", &dvllm::scatter_blocks_cpu);
  m.impl("scatter_update", &dvllm::scatter_update_cpu);
}
