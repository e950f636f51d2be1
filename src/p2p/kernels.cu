// gpudirect P2P copy and latency kernels. kernels.ptx is this file compiled by NVRTC 12.6
// (--gpu-architecture=compute_70, header lowered to .version 7.0; checked with ptxas for sm_70 and
// sm_90). Regenerate: scripts/regen-p2p-ptx.py. The PTX is committed so no NVRTC is needed at run time.
extern "C" __global__ void __launch_bounds__(512) gd_copy_v4(const int4* __restrict__ src, int4* __restrict__ dst, unsigned long long n)
{
    unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
    const unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;
    for (; i + 3 * stride < n; i += 4 * stride) {
        int4 a = src[i];
        int4 b = src[i + stride];
        int4 c = src[i + 2 * stride];
        int4 d = src[i + 3 * stride];
        dst[i] = a;
        dst[i + stride] = b;
        dst[i + 2 * stride] = c;
        dst[i + 3 * stride] = d;
    }
    for (; i < n; i += stride) {
        dst[i] = src[i];
    }
}

extern "C" __global__ void gd_latency_chase(const unsigned long long* start, unsigned long long iters, unsigned long long* out)
{
    if (blockIdx.x == 0 && threadIdx.x == 0) {
        const volatile unsigned long long* p = (const volatile unsigned long long*)start;
        for (unsigned long long k = 0; k < iters; ++k) {
            p = (const volatile unsigned long long*)(*p);
        }
        *out = (unsigned long long)p;
    }
}
