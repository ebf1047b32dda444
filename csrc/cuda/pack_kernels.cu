// CUDA kernels of paravt::pack_vision: fused uint8 -> normalised -> patchified pixels, and the
// per-patch metadata, for crops whose frames are already on the GPU (the DALI decode path).
// Torch-free by design (see pack_kernels.h); index arithmetic is shared with the CPU op
// through pack_index.h, so both paths are the same maths.
#include <cuda_runtime.h>

#include "../pack_index.h"
#include "pack_kernels.h"

namespace {

// Threads per block of the pixel kernel: one block per patch, 3*tp*p*p = 1536 elements at
// p=16, tp=2, so 256 threads write 6 coalesced floats each.
constexpr int kPixelThreads = 256;
constexpr int kMetaThreads = 256;

__device__ __forceinline__ int64_t find_crop(const paravt_crop_desc* crops, int64_t n,
                                             int64_t g) {
  // Last crop whose patch_offset <= g (crops are sorted by patch_offset).
  int64_t lo = 0, hi = n - 1;
  while (lo < hi) {
    const int64_t mid = (lo + hi + 1) >> 1;
    if (crops[mid].patch_offset <= g)
      lo = mid;
    else
      hi = mid - 1;
  }
  return lo;
}

template <typename Elem>
__global__ void pack_pixels_kernel(const paravt_crop_desc* __restrict__ crops, int64_t n_crops,
                                   const Elem* __restrict__ lut, Elem* __restrict__ out,
                                   int64_t p, int64_t tp, int64_t m) {
  __shared__ Elem s_lut[3 * 256];
  __shared__ paravt_crop_desc s_crop;
  const int64_t g = blockIdx.x;
  for (int k = threadIdx.x; k < 3 * 256; k += blockDim.x) s_lut[k] = lut[k];
  if (threadIdx.x == 0) s_crop = crops[find_crop(crops, n_crops, g)];
  __syncthreads();
  const paravt_crop_desc c = s_crop;
  const paravt::PatchPos pos = paravt::patch_position(g - c.patch_offset, c.gh, c.gw, m);
  const int64_t D = 3 * tp * p * p;
  Elem* dst = out + g * D;
  for (int64_t e = threadIdx.x; e < D; e += blockDim.x) {
    const paravt::PatchElem el = paravt::patch_element(e, tp, p);
    const int64_t f = paravt::source_frame(pos.ti, el.tpi, tp, c.T);
    const int64_t y = pos.row * p + el.py, x = pos.col * p + el.px;
    const uint8_t v = c.frames[((f * c.H + y) * c.W + x) * 3 + el.c];
    dst[e] = s_lut[el.c * 256 + v];
  }
}

__global__ void vision_meta_kernel(const paravt_crop_desc* __restrict__ crops, int64_t n_crops,
                                   int64_t n_patches, int64_t m, int64_t side,
                                   int64_t* __restrict__ pos_out, int64_t* __restrict__ idx_out,
                                   float* __restrict__ wt_out) {
  const int64_t g = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (g >= n_patches) return;
  const paravt_crop_desc& c = crops[find_crop(crops, n_crops, g)];
  const paravt::PatchPos pos = paravt::patch_position(g - c.patch_offset, c.gh, c.gw, m);
  pos_out[2 * g] = pos.row;
  pos_out[2 * g + 1] = pos.col;
  if (side > 0) paravt::interp_taps(pos.row, pos.col, c.gh, c.gw, side, idx_out + 4 * g, wt_out + 4 * g);
}

}  // namespace

extern "C" int paravt_pack_pixels_cuda(const paravt_crop_desc* crops, int64_t n_crops,
                                       const void* lut, void* out, int elem_bytes,
                                       int64_t n_patches, int64_t patch_size,
                                       int64_t temporal_patch_size, int64_t merge_size,
                                       void* stream) {
  if (n_patches == 0) return 0;
  if (n_patches > 0x7fffffffLL || (elem_bytes != 4 && elem_bytes != 2))
    return static_cast<int>(cudaErrorInvalidValue);
  const unsigned blocks = static_cast<unsigned>(n_patches);
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  if (elem_bytes == 4)
    pack_pixels_kernel<uint32_t><<<blocks, kPixelThreads, 0, s>>>(
        crops, n_crops, static_cast<const uint32_t*>(lut), static_cast<uint32_t*>(out),
        patch_size, temporal_patch_size, merge_size);
  else
    pack_pixels_kernel<uint16_t><<<blocks, kPixelThreads, 0, s>>>(
        crops, n_crops, static_cast<const uint16_t*>(lut), static_cast<uint16_t*>(out),
        patch_size, temporal_patch_size, merge_size);
  return static_cast<int>(cudaGetLastError());
}

extern "C" int paravt_vision_meta_cuda(const paravt_crop_desc* crops, int64_t n_crops,
                                       int64_t n_patches, int64_t merge_size, int64_t side,
                                       int64_t* position_ids, int64_t* interp_indices,
                                       float* interp_weights, void* stream) {
  if (n_patches == 0) return 0;
  const int64_t blocks = (n_patches + kMetaThreads - 1) / kMetaThreads;
  vision_meta_kernel<<<static_cast<unsigned>(blocks), kMetaThreads, 0,
                       static_cast<cudaStream_t>(stream)>>>(crops, n_crops, n_patches, merge_size,
                                                           side, position_ids, interp_indices,
                                                           interp_weights);
  return static_cast<int>(cudaGetLastError());
}

extern "C" const char* paravt_cuda_error_string(int code) {
  return cudaGetErrorString(static_cast<cudaError_t>(code));
}
