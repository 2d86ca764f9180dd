// GET_ROWS of float32 rows (ggml-cuda getrows.cu's k_get_rows_float): the rows of a batch whose
// logits are wanted (inp_out_ids), an F32 table. Rows of a weight in the file's type are the
// get_rows_<type> kernels of legacy.cu / kquants.cu / floats.cu (common.cuh's get_rows_impl, on
// the same decoders as the products). Launched by llamapy/backend/cuda_ops.py (`get_rows`); the
// numpy reference is kernels.py's get_rows.
#include "common.cuh"

// grid (ceil(n / blockDim.x), n_ids): y[i * sy + c] = t[ids[i] * st + c] for c < n. An id
// outside [0, n_rows) gives NaN (nothing is read outside the table).
extern "C" __global__ void get_rows_f32_rows(const float* __restrict__ t, long long st, int n_rows,
                                             const int* __restrict__ ids, float* __restrict__ y,
                                             long long sy, int n) {
    const int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= n) return;
    const long long i = blockIdx.y;
    const int row = ids[i];
    y[i * sy + c] = (row >= 0 && row < n_rows) ? t[(long long)row * st + c] : __int_as_float(0x7fc00000);
}
