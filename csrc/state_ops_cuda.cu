// CUDA kernels of dvllm's state-pool ops (schemas and CPU kernels: state_ops.cpp).
//
// The grid is (table column j) x (row r): a CUDA block handles one block-table entry at a time,
// i.e. one contiguous run of up to block_numel elements, its threads striding over it, so
// accesses coalesce and no thread divides an index. Grid-stride loops cover tables larger
// than the grid; launches go on the current stream. Block ids are not range-checked here
// (that would need a device sync): the block manager guarantees them; the CPU kernels check.

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <vector>

// The Coeff enumeration (scatter_update's coefficient columns), generated from dvllm/sampler_coeffs.py by
// setup.py's build (the wheel) or dvllm/_extension.py's (just in time) into the build directory.
#include "dvllm_coeffs.h"

namespace dvllm {

// Defined in state_ops.cpp: the same argument checks as the CPU entry points.
void check_gather_args(const at::Tensor& out, const at::Tensor& pool, const at::Tensor& block_table);
void check_scatter_args(const at::Tensor& src, const at::Tensor& pool, const at::Tensor& block_table);
void check_update_args(const at::Tensor& pool, const at::Tensor& latent_table, const at::Tensor& model_output,
                       const at::Tensor& coeffs, const std::optional<at::Tensor>& history_table,
                       const std::optional<at::Tensor>& noise);

namespace {


constexpr int kThreads = 256;
constexpr int64_t kMaxGrid = 65535;  // the limit of gridDim.y (and plenty for x)

dim3 grid_for(int64_t rows, int64_t nb) {
  return dim3(static_cast<unsigned>(std::min(nb, kMaxGrid)), static_cast<unsigned>(std::min(rows, kMaxGrid)));
}

// Threads per CUDA block: one per element of a pool block, in whole warps, at most kThreads.
unsigned threads_for(int64_t block_numel) {
  return static_cast<unsigned>(std::min<int64_t>(kThreads, (block_numel + 31) / 32 * 32));
}

// Copies are dtype-agnostic: T is an unsigned integer of the element's size.
template <typename T>
__global__ void gather_blocks_kernel(T* __restrict__ out,                // [R, numel]
                                     const T* __restrict__ pool,         // [num_blocks, B]
                                     const int32_t* __restrict__ table,  // [R, nb]
                                     int64_t rows, int64_t numel, int64_t block_numel, int64_t nb) {
  for (int64_t r = blockIdx.y; r < rows; r += gridDim.y) {
    for (int64_t j = blockIdx.x; j < nb; j += gridDim.x) {
      const int64_t offset = j * block_numel, n = min(block_numel, numel - offset);
      const T* from = pool + static_cast<int64_t>(table[r * nb + j]) * block_numel;
      T* to = out + r * numel + offset;
      for (int64_t k = threadIdx.x; k < n; k += blockDim.x) to[k] = from[k];
    }
  }
}

template <typename T>
__global__ void scatter_blocks_kernel(const T* __restrict__ src,          // [R, numel]
                                      T* __restrict__ pool,               // [num_blocks, B]
                                      const int32_t* __restrict__ table,  // [R, nb]
                                      int64_t rows, int64_t numel, int64_t block_numel, int64_t nb) {
  for (int64_t r = blockIdx.y; r < rows; r += gridDim.y) {
    for (int64_t j = blockIdx.x; j < nb; j += gridDim.x) {
      const int64_t offset = j * block_numel, n = min(block_numel, numel - offset);
      const T* from = src + r * numel + offset;
      T* to = pool + static_cast<int64_t>(table[r * nb + j]) * block_numel;
      for (int64_t k = threadIdx.x; k < n; k += blockDim.x) to[k] = from[k];
    }
  }
}

// Reads element i of a read-only [R, numel] input that is either float32 or the pool's dtype.
template <typename scalar_t>
struct RowsInput {
  const void* data;  // [R, numel], nullptr when the input is absent
  bool is_float;
  __device__ __forceinline__ float operator[](int64_t i) const {
    return is_float ? static_cast<const float*>(data)[i] : static_cast<float>(static_cast<const scalar_t*>(data)[i]);
  }
};

// clamp(x, -c, c) as torch.maximum(torch.minimum(x, c), -c) computes it: a NaN x stays NaN.
__device__ __forceinline__ float clamp_abs(float x, float c) {
  x = x > c ? c : x;
  return x < -c ? -c : x;
}

// The fused sampler update; keep in step with scatter_update_cpu (tests compare both to the reference).
template <typename scalar_t>
__global__ void scatter_update_kernel(scalar_t* __restrict__ pool,                // [num_blocks, B]
                                      const int32_t* __restrict__ latent_table,   // [R, nb]
                                      const int32_t* __restrict__ history_table,  // [R, slots, nb] or nullptr
                                      RowsInput<scalar_t> model_output,           // [R, numel]
                                      RowsInput<scalar_t> noise,                  // [R, numel], data may be nullptr
                                      const float* __restrict__ coeffs,           // [R, NUM_COEFFS]
                                      bool clip, int64_t rows, int64_t numel, int64_t block_numel, int64_t nb,
                                      int64_t slots) {
  static_assert(MAX_HISTORY == 3, "the weights below name each history slot's column");
  for (int64_t r = blockIdx.y; r < rows; r += gridDim.y) {
    const float* c = coeffs + r * NUM_COEFFS;
    const float ch[MAX_HISTORY] = {c[CH], c[CH1], c[CH2]};
    for (int64_t j = blockIdx.x; j < nb; j += gridDim.x) {
      const int64_t offset = j * block_numel, n = min(block_numel, numel - offset);
      scalar_t* x_seg = pool + static_cast<int64_t>(latent_table[r * nb + j]) * block_numel;
      scalar_t* h_seg[MAX_HISTORY] = {nullptr, nullptr, nullptr};  // present slots' runs; slot 0 is written
      for (int64_t s = 0; s < slots; ++s) {
        const int32_t* slot = history_table + (r * slots + s) * nb;
        if (slot[0] >= 0) h_seg[s] = pool + static_cast<int64_t>(slot[j]) * block_numel;
      }
      for (int64_t k = threadIdx.x; k < n; k += blockDim.x) {
        const int64_t i = r * numel + offset + k;  // flat index in model_output / noise
        const float x = static_cast<float>(x_seg[k]), mo = model_output[i];
        float x0 = c[AX] * x + c[AM] * mo;
        if (clip) x0 = clamp_abs(x0, c[CLIP]);
        float prev = c[CS] * x + c[CM] * mo + c[CX] * x0;
        if (noise.data) prev += c[CN] * noise[i];
#pragma unroll
        for (int s = 0; s < MAX_HISTORY; ++s) {
          if (h_seg[s]) prev += ch[s] * static_cast<float>(h_seg[s][k]);
        }
        if (h_seg[0]) h_seg[0][k] = static_cast<scalar_t>(x0);  // after every read: x0 replaces the oldest slot
        x_seg[k] = static_cast<scalar_t>(prev);
      }
    }
  }
}

// Calls f(T{}) with T an unsigned integer as wide as one pool element (2 or 4 bytes).
template <typename F>
void with_copy_type(int64_t element_size, const F& f) {
  if (element_size == 2) {
    f(uint16_t{});
  } else {
    TORCH_CHECK(element_size == 4, "dvllm: unexpected element size ", element_size);
    f(uint32_t{});
  }
}

}  // namespace

void gather_blocks_cuda(at::Tensor& out,                  // [R, numel], pool dtype
                        const at::Tensor& pool,           // [num_blocks, B]
                        const at::Tensor& block_table) {  // [R, ceil(numel / B)] int32
  check_gather_args(out, pool, block_table);
  const int64_t rows = out.size(0), numel = out.size(1);
  if (rows == 0 || numel == 0) return;
  const c10::cuda::CUDAGuard guard(pool.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  with_copy_type(pool.element_size(), [&](auto tag) {
    using T = decltype(tag);
    gather_blocks_kernel<T><<<grid_for(rows, block_table.size(1)), threads_for(pool.size(1)), 0, stream>>>(
        static_cast<T*>(out.mutable_data_ptr()), static_cast<const T*>(pool.const_data_ptr()),
        block_table.const_data_ptr<int32_t>(), rows, numel, pool.size(1), block_table.size(1));
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void scatter_blocks_cuda(const at::Tensor& src,            // [R, numel], pool dtype
                         at::Tensor& pool,                 // [num_blocks, B]
                         const at::Tensor& block_table) {  // [R, ceil(numel / B)] int32
  check_scatter_args(src, pool, block_table);
  const int64_t rows = src.size(0), numel = src.size(1);
  if (rows == 0 || numel == 0) return;
  const c10::cuda::CUDAGuard guard(pool.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  with_copy_type(pool.element_size(), [&](auto tag) {
    using T = decltype(tag);
    scatter_blocks_kernel<T><<<grid_for(rows, block_table.size(1)), threads_for(pool.size(1)), 0, stream>>>(
        static_cast<const T*>(src.const_data_ptr()), static_cast<T*>(pool.mutable_data_ptr()),
        block_table.const_data_ptr<int32_t>(), rows, numel, pool.size(1), block_table.size(1));
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void scatter_update_cuda(at::Tensor& pool,                                 // [num_blocks, B]
                         const at::Tensor& latent_table,                   // [R, nb] int32
                         const at::Tensor& model_output,                   // [R, numel] float32 or pool dtype
                         const at::Tensor& coeffs,                         // [R, NUM_COEFFS] float32
                         const std::optional<at::Tensor>& history_table,  // [R, K, nb] int32, slot of -1: none
                         const std::optional<at::Tensor>& noise,          // [R, numel] float32 or pool dtype
                         bool clip) {
  check_update_args(pool, latent_table, model_output, coeffs, history_table, noise);
  const int64_t rows = model_output.size(0), numel = model_output.size(1);
  if (rows == 0 || numel == 0) return;
  const c10::cuda::CUDAGuard guard(pool.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, pool.scalar_type(), "scatter_update_cuda", [&] {
    const RowsInput<scalar_t> mo{model_output.const_data_ptr(), model_output.scalar_type() == at::kFloat};
    const RowsInput<scalar_t> nz{noise ? noise->const_data_ptr() : nullptr,
                                 noise && noise->scalar_type() == at::kFloat};
    scatter_update_kernel<scalar_t><<<grid_for(rows, latent_table.size(1)), threads_for(pool.size(1)), 0, stream>>>(
        pool.mutable_data_ptr<scalar_t>(), latent_table.const_data_ptr<int32_t>(),
        history_table ? history_table->const_data_ptr<int32_t>() : nullptr, mo, nz, coeffs.const_data_ptr<float>(),
        clip, rows, numel, pool.size(1), latent_table.size(1), history_table ? history_table->size(1) : 0);
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// The coefficient layout as nvcc compiled it into these kernels (see coeff_layout in state_ops.cpp).
std::vector<int64_t> cuda_coeff_layout() { return DVLLM_COEFF_LAYOUT; }

// The architectures the kernels were compiled for (e.g. 800, 900): nvcc's own list.
std::vector<int64_t> cuda_archs() { return {__CUDA_ARCH_LIST__}; }

}  // namespace dvllm

TORCH_LIBRARY_FRAGMENT(dvllm, m) {
  m.def("cuda_coeff_layout() -> int[]", &dvllm::cuda_coeff_layout);
  m.def("cuda_archs() -> int[]", &dvllm::cuda_archs);
}

TORCH_LIBRARY_IMPL(dvllm, CUDA, m) {
  m.impl("gather_blocks", &dvllm::gather_blocks_cuda);
  m.impl("scatter_blocks", &dvllm::scatter_blocks_cuda);
  m.impl("scatter_update", &dvllm::scatter_update_cuda);
}
