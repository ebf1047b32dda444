// CUDA implementation of paravt::pack_vision: the torch side. Validates on the host, builds
// the crop descriptors and the host-known metadata (cu_seqlens, window index), and launches
// the torch-free kernels of csrc/cuda/pack_kernels.cu through their C API.
// Compiled only when torch has CUDA (setup.py defines PARAVT_WITH_CUDA).
#ifdef PARAVT_WITH_CUDA
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/types.h>

#include <cstring>

#include "cuda/pack_kernels.h"
#include "pack_vision.h"

namespace paravt {

namespace {
void check_cuda(int code, const char* what) {
  TORCH_CHECK(code == 0, "pack_vision (CUDA): ", what, " failed: ", paravt_cuda_error_string(code),
              ". Check that the crops are valid CUDA tensors on one device.");
}
}  // namespace

PackOut pack_vision_cuda(const std::vector<at::Tensor>& crops_in, const at::Tensor& lut_in,
                         int64_t patch_size, int64_t temporal_patch_size, int64_t merge_size,
                         int64_t num_grid_per_side, int64_t window_size) {
  const CropLayout L = crop_layout(crops_in, patch_size, temporal_patch_size, merge_size);
  const auto device = crops_in[0].device();
  check_lut(lut_in, device);
  const c10::cuda::CUDAGuard guard(device);
  auto stream = c10::cuda::getCurrentCUDAStream(device.index());
  const int64_t n = static_cast<int64_t>(crops_in.size());
  std::vector<at::Tensor> crops;  // keeps contiguous copies alive until the kernels ran
  crops.reserve(n);
  std::vector<paravt_crop_desc> desc(n);
  for (int64_t i = 0; i < n; ++i) {
    crops.push_back(crops_in[i].contiguous());
    desc[i].frames = crops[i].data_ptr<uint8_t>();
    desc[i].T = L.T[i];
    desc[i].H = L.H[i];
    desc[i].W = L.W[i];
    desc[i].gh = L.grid[3 * i + 1];
    desc[i].gw = L.grid[3 * i + 2];
    desc[i].patch_offset = L.patch_offset[i];
  }
  const auto bytes = static_cast<int64_t>(n * sizeof(paravt_crop_desc));
  at::Tensor desc_host = at::empty({bytes}, at::TensorOptions().dtype(at::kByte).pinned_memory(true));
  std::memcpy(desc_host.data_ptr<uint8_t>(), desc.data(), bytes);
  at::Tensor desc_dev = desc_host.to(device, /*non_blocking=*/true);
  const auto* desc_ptr = reinterpret_cast<const paravt_crop_desc*>(desc_dev.data_ptr<uint8_t>());

  const at::Tensor lut = lut_in.contiguous();
  const int64_t N = L.patch_offset[n];
  const int64_t D = 3 * temporal_patch_size * patch_size * patch_size;
  auto f32 = at::TensorOptions().dtype(at::kFloat).device(device);
  auto i64 = at::TensorOptions().dtype(at::kLong).device(device);
  // The output dtype is the LUT's (float32, or bf16/fp16 for half the bytes).
  at::Tensor pixels = at::empty({N, D}, f32.dtype(lut.scalar_type()));
  check_cuda(paravt_pack_pixels_cuda(desc_ptr, n, lut.data_ptr(), pixels.data_ptr(),
                                     static_cast<int>(lut.element_size()), N, patch_size,
                                     temporal_patch_size, merge_size, stream.stream()),
             "pack_pixels kernel launch");

  const int64_t n_tap = num_grid_per_side > 0 ? N : 0;
  at::Tensor pos = at::empty({N, 2}, i64);
  at::Tensor idx = at::empty({n_tap, 4}, i64);
  at::Tensor wt = at::empty({n_tap, 4}, f32);
  check_cuda(paravt_vision_meta_cuda(desc_ptr, n, N, merge_size, num_grid_per_side,
                                     pos.data_ptr<int64_t>(), idx.data_ptr<int64_t>(),
                                     wt.data_ptr<float>(), stream.stream()),
             "vision_meta kernel launch");

  // Host-known, tiny, and needed on the host anyway (max_seqlen): build there, copy once.
  at::Tensor grid = at::from_blob(const_cast<int64_t*>(L.grid.data()), {n, 3}, at::kLong).clone();
  at::Tensor cu = cu_seqlens_host(L.grid);
  at::Tensor win_idx = at::empty({0}, at::kLong);
  at::Tensor cu_win = at::empty({0}, at::kInt);
  if (window_size > 0)
    std::tie(win_idx, cu_win) = window_index_host(L.grid, merge_size, window_size, patch_size);
  return {pixels,
          grid.to(device, true),
          cu.to(device, true),
          pos,
          idx,
          wt,
          win_idx.to(device, true),
          cu_win.to(device, true)};
}

}  // namespace paravt
#endif  // PARAVT_WITH_CUDA
