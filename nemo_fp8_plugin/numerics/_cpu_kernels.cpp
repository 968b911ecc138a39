// Single-pass CPU FP8 quantizers for nemo_fp8_plugin.numerics (see _cpu.py).
//
// Built at first use with the system C++ compiler (plain C ABI, loaded with ctypes; no torch
// headers, so a build takes seconds). Every function reproduces the eager reference in
// quantize.py bit for bit: the same fp32 products, the same float64 divisions rounded once to
// fp32, and an integer fp32 -> FP8 encoder (round to nearest even, saturating, NaN -> 0x7F
// with the sign kept, as torch's CPU cast writes it). With AVX2 the encoder and the amax run
// eight lanes at a time; without it the same arithmetic runs one element at a time.
//
// Work is split over tile rows (1 row for 1xN tiles, 128 rows for 128x128), each cut into
// panels of whole tiles of at most 4 MiB, threaded with OpenMP (dynamic chunks); the amax
// pass over a panel leaves it in cache for the scale-and-cast pass, so the input is read
// from memory once.
//
// Also here: the emulated linear's fake quantizers (nf8_fake_quant_*: quantize and
// dequantize to fp32 in one pass, decoding through torch's own float8 table) and NVFP4
// (nf8_nvfp4: numerics/nvfp4.py's quantizer; the RHT and the stochastic-rounding draws
// come from the caller, computed by the reference's own torch ops).

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>
#include <omp.h>
#if defined(__AVX2__) && defined(__F16C__) && !defined(NEMO_FP8_NO_SIMD)
#include <immintrin.h>
#define NF8_SIMD 1
#else
#define NF8_SIMD 0
#endif

namespace {

enum InDtype { IN_F32 = 0, IN_BF16 = 1, IN_F16 = 2 };

inline uint32_t f2u(float f) { uint32_t u; std::memcpy(&u, &f, 4); return u; }
inline float u2f(uint32_t u) { float f; std::memcpy(&f, &u, 4); return f; }

// Exact IEEE half -> float (subnormals, inf, NaN kept).
inline float half_to_float(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000) << 16;
    uint32_t exp = (h >> 10) & 0x1F;
    uint32_t mant = h & 0x3FF;
    if (exp == 0x1F) return u2f(sign | 0x7F800000u | (mant << 13) | (mant ? 0x400000u : 0));
    if (exp == 0) {
        if (mant == 0) return u2f(sign);
        // subnormal: mant * 2^-24, exact in fp32
        float v = (float)mant * 5.9604644775390625e-08f;
        return sign ? -v : v;
    }
    return u2f(sign | ((exp + 112) << 23) | (mant << 13));
}

template <int IN>
inline float load1(const void* p, int64_t i) {
    if (IN == IN_F32) return static_cast<const float*>(p)[i];
    if (IN == IN_BF16) return u2f((uint32_t) static_cast<const uint16_t*>(p)[i] << 16);
    return half_to_float(static_cast<const uint16_t*>(p)[i]);
}

// Format constants: M mantissa bits, B exponent bias.
template <int FMT> struct Fmt;
template <> struct Fmt<0> {  // E4M3 (fn)
    static constexpr int M = 3, B = 7;
    static constexpr uint32_t MAX_BITS = 0x43E00000u;    // 448
    static constexpr uint32_t MIN_NORMAL = 0x3C800000u;  // 2^-6
    static constexpr float SUB_MUL = 512.0f;             // 1 / 2^-9
    static constexpr float MAXF = 448.0f;
};
template <> struct Fmt<1> {  // E5M2
    static constexpr int M = 2, B = 15;
    static constexpr uint32_t MAX_BITS = 0x47600000u;    // 57344
    static constexpr uint32_t MIN_NORMAL = 0x38800000u;  // 2^-14
    static constexpr float SUB_MUL = 65536.0f;           // 1 / 2^-16
    static constexpr float MAXF = 57344.0f;
};

// fp32 -> FP8 byte: clamp to +-max, round to nearest even, NaN -> sign | 0x7F.
template <int FMT>
inline uint8_t encode1(float v) {
    typedef Fmt<FMT> F;
    constexpr int SH = 23 - F::M;
    constexpr uint32_t ADJ = (uint32_t)(127 - F::B) << F::M;
    uint32_t b = f2u(v);
    uint32_t s = (b >> 24) & 0x80u;
    uint32_t a = b & 0x7FFFFFFFu;
    if (a > 0x7F800000u) return (uint8_t)(s | 0x7Fu);
    if (a > F::MAX_BITS) a = F::MAX_BITS;
    uint32_t code;
    if (a >= F::MIN_NORMAL) {
        uint32_t r = a + ((1u << (SH - 1)) - 1u) + ((a >> SH) & 1u);
        code = (r >> SH) - ADJ;
    } else {
        code = (uint32_t)std::nearbyint(u2f(a) * F::SUB_MUL);
    }
    return (uint8_t)(s | code);
}

#if NF8_SIMD
template <int IN>
inline __m256 load8(const void* p, int64_t i) {
    if (IN == IN_F32) return _mm256_loadu_ps(static_cast<const float*>(p) + i);
    __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(p) + i));
    if (IN == IN_BF16) return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    return _mm256_cvtph_ps(h);
}

inline __m256 abs8(__m256 v) {
    return _mm256_and_ps(v, _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF)));
}

// Eight fp32 -> eight codes in the low byte of each int32 lane.
template <int FMT>
inline __m256i encode8(__m256 v) {
    typedef Fmt<FMT> F;
    constexpr int SH = 23 - F::M;
    constexpr int ADJ = (127 - F::B) << F::M;
    __m256i b = _mm256_castps_si256(v);
    __m256i s = _mm256_and_si256(_mm256_srli_epi32(b, 24), _mm256_set1_epi32(0x80));
    __m256i a = _mm256_and_si256(b, _mm256_set1_epi32(0x7FFFFFFF));
    __m256i nan = _mm256_cmpgt_epi32(a, _mm256_set1_epi32(0x7F800000));
    a = _mm256_min_epi32(a, _mm256_set1_epi32((int)F::MAX_BITS));
    __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(a, SH), _mm256_set1_epi32(1));
    __m256i r = _mm256_add_epi32(_mm256_add_epi32(a, _mm256_set1_epi32((1 << (SH - 1)) - 1)), lsb);
    __m256i ncode = _mm256_sub_epi32(_mm256_srli_epi32(r, SH), _mm256_set1_epi32(ADJ));
    __m256 t = _mm256_mul_ps(_mm256_castsi256_ps(a), _mm256_set1_ps(F::SUB_MUL));
    __m256i scode = _mm256_cvttps_epi32(_mm256_round_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    __m256i normal = _mm256_cmpgt_epi32(a, _mm256_set1_epi32((int)F::MIN_NORMAL - 1));
    __m256i code = _mm256_blendv_epi8(scode, ncode, normal);
    code = _mm256_blendv_epi8(code, _mm256_set1_epi32(0x7F), nan);
    return _mm256_or_si256(code, s);
}

// 32 codes (four vectors of int32 lanes, each 0..255) -> 32 bytes in order.
inline void store32(uint8_t* dst, __m256i c0, __m256i c1, __m256i c2, __m256i c3) {
    __m256i p01 = _mm256_packus_epi32(c0, c1);
    __m256i p23 = _mm256_packus_epi32(c2, c3);
    __m256i p = _mm256_packus_epi16(p01, p23);
    p = _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), p);
}

inline float hmax8(__m256 v) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_shuffle_ps(m, m, 1));
    return _mm_cvtss_f32(m);
}
#endif

// max |x| over [i, i + n) ignoring NaN, folded into acc (never NaN).
template <int IN>
inline float span_amax(const void* x, int64_t i, int64_t n, float acc) {
    int64_t j = 0;
#if NF8_SIMD
    if (n >= 8) {
        // max_ps returns its second operand when either is NaN: the accumulator survives a NaN.
        __m256 va = _mm256_setzero_ps(), vb = _mm256_setzero_ps();
        for (; j + 16 <= n; j += 16) {
            va = _mm256_max_ps(abs8(load8<IN>(x, i + j)), va);
            vb = _mm256_max_ps(abs8(load8<IN>(x, i + j + 8)), vb);
        }
        for (; j + 8 <= n; j += 8) va = _mm256_max_ps(abs8(load8<IN>(x, i + j)), va);
        float m = hmax8(_mm256_max_ps(va, vb));
        acc = m > acc ? m : acc;
    }
#endif
    for (; j < n; ++j) {
        float a = std::fabs(load1<IN>(x, i + j));
        acc = a > acc ? a : acc;
    }
    return acc;
}

// out[i + j] = encode((x[i + j] * m1) * m2) for j < n; m2 == 1 skips the second product.
template <int IN, int FMT>
inline void span_cast(const void* x, int64_t i, int64_t n, float m1, float m2, uint8_t* out) {
    int64_t j = 0;
    const bool two = m2 != 1.0f;
#if NF8_SIMD
    const __m256 vm1 = _mm256_set1_ps(m1), vm2 = _mm256_set1_ps(m2);
    for (; j + 32 <= n; j += 32) {
        __m256 v0 = _mm256_mul_ps(load8<IN>(x, i + j), vm1);
        __m256 v1 = _mm256_mul_ps(load8<IN>(x, i + j + 8), vm1);
        __m256 v2 = _mm256_mul_ps(load8<IN>(x, i + j + 16), vm1);
        __m256 v3 = _mm256_mul_ps(load8<IN>(x, i + j + 24), vm1);
        if (two) {
            v0 = _mm256_mul_ps(v0, vm2); v1 = _mm256_mul_ps(v1, vm2);
            v2 = _mm256_mul_ps(v2, vm2); v3 = _mm256_mul_ps(v3, vm2);
        }
        store32(out + i + j, encode8<FMT>(v0), encode8<FMT>(v1), encode8<FMT>(v2), encode8<FMT>(v3));
    }
#endif
    for (; j < n; ++j) {
        float v = load1<IN>(x, i + j) * m1;
        if (two) v = v * m2;
        out[i + j] = encode1<FMT>(v);
    }
}

// TE's compute_scale_from_amax, as scaling.scale_from_amax computes it.
inline float scale_from_amax(float amax, float fmax, int pow2, int eps_on, float eps, float vinf) {
    if (eps_on && amax < eps) amax = eps;
    if (std::isinf(amax) || amax == 0.0f || std::isnan(amax)) return 1.0f;
    float s = (float)((double)fmax / (double)amax);
    if (std::isinf(s)) s = vinf;
    if (pow2) s = u2f(f2u(s) & 0xFF800000u);
    return s;
}

inline float reciprocal(float s) { return (float)(1.0 / (double)s); }

// scaling.e8m0_from_amax: the biased E8M0 exponent of a block.
inline uint32_t e8m0_from_amax(float amax, float rcp) {
    float val = amax * rcp;
    if (std::isnan(val)) return 0xFF;
    if (std::isinf(val)) return 0xFE;
    uint32_t bits = f2u(val);
    uint32_t exp = (bits >> 23) & 0xFF, mant = bits & 0x7FFFFF;
    bool up = mant > 0 && exp != 0xFE && !(exp == 0 && mant <= 0x400000);
    return exp + (up ? 1 : 0);
}

// scaling.e8m0_data_factors
inline void e8m0_factors(uint32_t e, float* m1, float* m2) {
    uint32_t ee = e == 254 ? 253 : e;
    *m1 = ee == 255 ? u2f(0x7FFFFFFFu) : u2f((254u - ee) << 23);
    *m2 = e == 254 ? 0.5f : 1.0f;
}

#if NF8_SIMD
// Eight vectors -> one vector of their eight horizontal maxima (lane t = max of v[t]).
// The inputs hold no NaN (the accumulators drop them), so any max order gives the same value.
inline __m256 hmax8x8(const __m256* v) {
    __m256 m01 = _mm256_max_ps(_mm256_shuffle_ps(v[0], v[1], 0x88), _mm256_shuffle_ps(v[0], v[1], 0xDD));
    __m256 m23 = _mm256_max_ps(_mm256_shuffle_ps(v[2], v[3], 0x88), _mm256_shuffle_ps(v[2], v[3], 0xDD));
    __m256 m45 = _mm256_max_ps(_mm256_shuffle_ps(v[4], v[5], 0x88), _mm256_shuffle_ps(v[4], v[5], 0xDD));
    __m256 m67 = _mm256_max_ps(_mm256_shuffle_ps(v[6], v[7], 0x88), _mm256_shuffle_ps(v[6], v[7], 0xDD));
    __m256 m0123 = _mm256_max_ps(_mm256_shuffle_ps(m01, m23, 0x88), _mm256_shuffle_ps(m01, m23, 0xDD));
    __m256 m4567 = _mm256_max_ps(_mm256_shuffle_ps(m45, m67, 0x88), _mm256_shuffle_ps(m45, m67, 0xDD));
    return _mm256_max_ps(_mm256_permute2f128_ps(m0123, m4567, 0x20),
                         _mm256_permute2f128_ps(m0123, m4567, 0x31));
}

// MXFP8 1x32 along one row, eight blocks (256 elements) at a time: the amaxes, exponents and
// data factors of the eight blocks are computed in vector lanes (e8m0_from_amax and
// e8m0_factors, lane-wise), which the per-block scalar path spends most of its time on.
// Handles blocks [t0, t0 + 8 * groups) of the row starting at element `row`.
template <int IN, int FMT>
inline void mx_row_groups(const void* x, int64_t row, int64_t t0, int64_t groups, float rcp,
                          uint8_t* out, uint8_t* e_out) {
    const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
    for (int64_t g = 0; g < groups; ++g) {
        const int64_t c0 = (t0 + 8 * g) * 32;
        __m256 acc[8];
        for (int t = 0; t < 8; ++t) {
            const int64_t i = row + c0 + 32 * t;
            __m256 a = _mm256_max_ps(_mm256_and_ps(load8<IN>(x, i), absmask), _mm256_setzero_ps());
            a = _mm256_max_ps(_mm256_and_ps(load8<IN>(x, i + 8), absmask), a);
            a = _mm256_max_ps(_mm256_and_ps(load8<IN>(x, i + 16), absmask), a);
            acc[t] = _mm256_max_ps(_mm256_and_ps(load8<IN>(x, i + 24), absmask), a);
        }
        const __m256 amax = hmax8x8(acc);
        // e8m0_from_amax, lane-wise
        const __m256i bits = _mm256_castps_si256(_mm256_mul_ps(amax, _mm256_set1_ps(rcp)));
        const __m256i exp = _mm256_and_si256(_mm256_srli_epi32(bits, 23), _mm256_set1_epi32(0xFF));
        const __m256i mant = _mm256_and_si256(bits, _mm256_set1_epi32(0x7FFFFF));
        const __m256i zero = _mm256_setzero_si256();
        const __m256i has_mant = _mm256_andnot_si256(_mm256_cmpeq_epi32(mant, zero), _mm256_set1_epi32(-1));
        const __m256i not_fe = _mm256_andnot_si256(_mm256_cmpeq_epi32(exp, _mm256_set1_epi32(0xFE)), _mm256_set1_epi32(-1));
        const __m256i small = _mm256_and_si256(_mm256_cmpeq_epi32(exp, zero),
                                               _mm256_cmpgt_epi32(_mm256_set1_epi32(0x400001), mant));
        const __m256i up = _mm256_andnot_si256(small, _mm256_and_si256(has_mant, not_fe));
        __m256i e = _mm256_sub_epi32(exp, up);  // up is -1 where set
        const __m256i is_ff = _mm256_cmpeq_epi32(exp, _mm256_set1_epi32(0xFF));
        const __m256i special = _mm256_blendv_epi8(_mm256_set1_epi32(0xFE), _mm256_set1_epi32(0xFF), has_mant);
        e = _mm256_blendv_epi8(e, special, is_ff);
        // e8m0_factors, lane-wise
        const __m256i is_fe = _mm256_cmpeq_epi32(e, _mm256_set1_epi32(0xFE));
        const __m256i ee = _mm256_add_epi32(e, is_fe);  // 254 -> 253
        __m256i m1b = _mm256_slli_epi32(_mm256_sub_epi32(_mm256_set1_epi32(254), ee), 23);
        m1b = _mm256_blendv_epi8(m1b, _mm256_set1_epi32(0x7FFFFFFF),
                                 _mm256_cmpeq_epi32(ee, _mm256_set1_epi32(0xFF)));
        const __m256 m1 = _mm256_castsi256_ps(m1b);
        const __m256 m2 = _mm256_blendv_ps(_mm256_set1_ps(1.0f), _mm256_set1_ps(0.5f), _mm256_castsi256_ps(is_fe));
        alignas(32) int32_t ev[8];
        _mm256_store_si256(reinterpret_cast<__m256i*>(ev), e);
        for (int t = 0; t < 8; ++t) e_out[t0 + 8 * g + t] = (uint8_t)ev[t];
        for (int t = 0; t < 8; ++t) {
            const __m256i lane = _mm256_set1_epi32(t);
            const __m256 f1 = _mm256_permutevar8x32_ps(m1, lane);
            const __m256 f2 = _mm256_permutevar8x32_ps(m2, lane);
            const int64_t i = row + c0 + 32 * t;
            __m256 v0 = _mm256_mul_ps(_mm256_mul_ps(load8<IN>(x, i), f1), f2);
            __m256 v1 = _mm256_mul_ps(_mm256_mul_ps(load8<IN>(x, i + 8), f1), f2);
            __m256 v2 = _mm256_mul_ps(_mm256_mul_ps(load8<IN>(x, i + 16), f1), f2);
            __m256 v3 = _mm256_mul_ps(_mm256_mul_ps(load8<IN>(x, i + 24), f1), f2);
            store32(out + i, encode8<FMT>(v0), encode8<FMT>(v1), encode8<FMT>(v2), encode8<FMT>(v3));
        }
    }
}
#endif

struct Job {
    const void* x;
    int64_t batch, m, k;
    int bm, bn, mx;
    int pow2, eps_on;
    float eps, vinf;
    uint8_t* out;
    float* scale_inv;  // block scaling
    uint8_t* e_out;    // MXFP8
    int64_t panel_bytes;  // <= 0: the default (4 MiB)
};

template <int IN, int FMT>
void tiles(const Job& J, int nthreads) {
    const int64_t mt = (J.m + J.bm - 1) / J.bm, kt = (J.k + J.bn - 1) / J.bn;
    // A unit of work is one tile row, cut into panels of whole tiles of at most 4 MiB of
    // input, so that the scale-and-cast pass re-reads the panel from cache, not from memory
    // (a 128-row bf16 tile row of a 14336-wide weight is 3.5 MiB; smaller panels measured no
    // better on a 2-core Zen 3: more concurrent streams for the prefetcher).
    const int64_t esize = IN == IN_F32 ? 4 : 2;
    const int64_t tile_bytes = (int64_t)J.bm * J.bn * esize;
    const int64_t panel_bytes = J.panel_bytes > 0 ? J.panel_bytes : ((int64_t)1 << 22);
    int64_t pt = tile_bytes > 0 ? panel_bytes / tile_bytes : kt;
    pt = pt < 1 ? 1 : (pt > kt ? kt : pt);
    const int64_t panels = kt > 0 ? (kt + pt - 1) / pt : 0;
    const int64_t units = J.batch * mt * panels;
    const float fmax = Fmt<FMT>::MAXF;
    const float rcp = (float)(1.0 / (double)fmax);
    // Chunks of at least 64K elements, handed out dynamically: on a shared machine a thread
    // that is descheduled for a while does not hold the others up at the end.
    const int64_t per_unit = (int64_t)J.bm * (pt * J.bn);
    const int chunk = (int)(per_unit >= 65536 ? 1 : 65536 / (per_unit > 0 ? per_unit : 1));
#pragma omp parallel num_threads(nthreads)
    {
        std::vector<float> amax(pt), m1(pt), m2(pt);
#pragma omp for schedule(dynamic, chunk)
        for (int64_t u = 0; u < units; ++u) {
            const int64_t p = u % panels, row_unit = u / panels;
            const int64_t b = row_unit / mt, rb = row_unit % mt;
            const int64_t r0 = rb * J.bm;
            const int64_t r1 = r0 + J.bm < J.m ? r0 + J.bm : J.m;
            const int64_t t0 = p * pt;
            const int64_t nt = t0 + pt <= kt ? pt : kt - t0;
            const int64_t base = b * J.m * J.k;
            const int64_t sbase = row_unit * kt + t0;  // scales are [batch, mt, kt]
            int64_t done = 0;  // tiles of this panel finished by the vector-lane path
#if NF8_SIMD
            if (J.mx && J.bm == 1 && J.bn == 32) {
                // full blocks only: a partial last block takes the path below
                int64_t full = nt;
                if (t0 + nt == kt && J.k % 32) full -= 1;
                const int64_t groups = full / 8;
                mx_row_groups<IN, FMT>(J.x, base + r0 * J.k, t0, groups, rcp, J.out,
                                       J.e_out + sbase - t0);
                done = groups * 8;
            }
#endif
            for (int64_t t = done; t < nt; ++t) amax[t] = 0.0f;
            for (int64_t r = r0; r < r1; ++r) {
                const int64_t row = base + r * J.k;
                for (int64_t t = done; t < nt; ++t) {
                    const int64_t c0 = (t0 + t) * J.bn;
                    const int64_t n = c0 + J.bn <= J.k ? J.bn : J.k - c0;
                    amax[t] = span_amax<IN>(J.x, row + c0, n, amax[t]);
                }
            }
            for (int64_t t = done; t < nt; ++t) {
                if (J.mx) {
                    uint32_t e = e8m0_from_amax(amax[t], rcp);
                    J.e_out[sbase + t] = (uint8_t)e;
                    e8m0_factors(e, &m1[t], &m2[t]);
                } else {
                    float s = scale_from_amax(amax[t], fmax, J.pow2, J.eps_on, J.eps, J.vinf);
                    J.scale_inv[sbase + t] = reciprocal(s);
                    m1[t] = s;
                    m2[t] = 1.0f;
                }
            }
            for (int64_t r = r0; r < r1; ++r) {
                const int64_t row = base + r * J.k;
                for (int64_t t = done; t < nt; ++t) {
                    const int64_t c0 = (t0 + t) * J.bn;
                    const int64_t n = c0 + J.bn <= J.k ? J.bn : J.k - c0;
                    span_cast<IN, FMT>(J.x, row + c0, n, m1[t], m2[t], J.out);
                }
            }
        }
    }
}

template <int IN>
float amax_all(const void* x, int64_t n, int nthreads) {
    const int64_t chunk = 1 << 16;
    const int64_t nchunks = (n + chunk - 1) / chunk;
    float result = 0.0f;
#pragma omp parallel num_threads(nthreads)
    {
        float acc = 0.0f;
#pragma omp for schedule(dynamic, 4)
        for (int64_t c = 0; c < nchunks; ++c) {
            const int64_t i = c * chunk;
            acc = span_amax<IN>(x, i, i + chunk <= n ? chunk : n - i, acc);
        }
#pragma omp critical
        result = acc > result ? acc : result;
    }
    return result;
}

template <int IN, int FMT>
void cast_all(const void* x, int64_t n, float scale, uint8_t* out, int nthreads) {
    const int64_t chunk = 1 << 16;
    const int64_t nchunks = (n + chunk - 1) / chunk;
#pragma omp parallel for num_threads(nthreads) schedule(dynamic, 4)
    for (int64_t c = 0; c < nchunks; ++c) {
        const int64_t i = c * chunk;
        span_cast<IN, FMT>(x, i, i + chunk <= n ? chunk : n - i, scale, 1.0f, out);
    }
}



// ---------------------------------------------------------------------------------------
// Fake quantization (quantize, then dequantize to fp32, in one pass): the emulated linear's
// operands. out = lut[code(x * m1 * m2)] * dq per tile, where lut is torch's own float8 ->
// fp32 table (passed in, so a NaN code decodes to torch's bits) and dq the tile's
// dequantization factor (fp32 scale_inv, or 2^(e - 127) from torch's E8M0 table). The
// second product is by 1.0 for block scaling, which changes no bit (NaN payloads included).

template <int IN, int FMT>
inline void span_fq(const void* x, int64_t i, int64_t n, float m1, float m2, float dq,
                    const float* lut, float* out) {
    int64_t j = 0;
#if NF8_SIMD
    const __m256 vm1 = _mm256_set1_ps(m1), vm2 = _mm256_set1_ps(m2), vdq = _mm256_set1_ps(dq);
    for (; j + 8 <= n; j += 8) {
        __m256 v = _mm256_mul_ps(_mm256_mul_ps(load8<IN>(x, i + j), vm1), vm2);
        __m256 d = _mm256_i32gather_ps(lut, encode8<FMT>(v), 4);
        _mm256_storeu_ps(out + i + j, _mm256_mul_ps(d, vdq));
    }
#endif
    for (; j < n; ++j) {
        float v = (load1<IN>(x, i + j) * m1) * m2;
        out[i + j] = lut[encode1<FMT>(v)] * dq;
    }
}

struct FQJob {
    const void* x;
    int64_t m, k;
    int bm, bn, mx, pow2, eps_on;
    float eps, vinf;
    float* out;
    const float* lut;    // float8 byte -> fp32 (torch's conversion)
    const float* e8lut;  // E8M0 byte -> fp32 (torch's conversion)
};

// The scale factors of one tile from its (NaN-ignoring) amax.
inline void tile_factors(const FQJob& J, float amax, float fmax, float rcp, float* m1, float* m2,
                         float* dq) {
    if (J.mx) {
        uint32_t e = e8m0_from_amax(amax, rcp);
        e8m0_factors(e, m1, m2);
        *dq = J.e8lut[e];
    } else {
        float s = scale_from_amax(amax, fmax, J.pow2, J.eps_on, J.eps, J.vinf);
        *m1 = s;
        *m2 = 1.0f;
        *dq = reciprocal(s);
    }
}

// Tiles whose rows are contiguous runs (bn >= 2): one tile row at a time, amax then cast,
// the tile row still in cache for the second pass.
template <int IN, int FMT>
void fq_rows(const FQJob& J, int nthreads) {
    const int64_t mt = (J.m + J.bm - 1) / J.bm, kt = (J.k + J.bn - 1) / J.bn;
    const float fmax = Fmt<FMT>::MAXF;
    const float rcp = (float)(1.0 / (double)fmax);
    const int64_t per_unit = (int64_t)J.bm * J.k;
    const int chunk = (int)(per_unit >= 65536 ? 1 : 65536 / (per_unit > 0 ? per_unit : 1));
#pragma omp parallel num_threads(nthreads)
    {
        std::vector<float> amax(kt), m1(kt), m2(kt), dq(kt);
#pragma omp for schedule(dynamic, chunk)
        for (int64_t rb = 0; rb < mt; ++rb) {
            const int64_t r0 = rb * J.bm, r1 = r0 + J.bm < J.m ? r0 + J.bm : J.m;
            for (int64_t t = 0; t < kt; ++t) amax[t] = 0.0f;
            for (int64_t r = r0; r < r1; ++r)
                for (int64_t t = 0; t < kt; ++t) {
                    const int64_t c0 = t * J.bn, n = c0 + J.bn <= J.k ? J.bn : J.k - c0;
                    amax[t] = span_amax<IN>(J.x, r * J.k + c0, n, amax[t]);
                }
            for (int64_t t = 0; t < kt; ++t) tile_factors(J, amax[t], fmax, rcp, &m1[t], &m2[t], &dq[t]);
            for (int64_t r = r0; r < r1; ++r)
                for (int64_t t = 0; t < kt; ++t) {
                    const int64_t c0 = t * J.bn, n = c0 + J.bn <= J.k ? J.bn : J.k - c0;
                    span_fq<IN, FMT>(J.x, r * J.k + c0, n, m1[t], m2[t], dq[t], J.lut, J.out);
                }
        }
    }
}

// Column tiles (bn == 1: a bm x 1 tile is a run of one column, the column-wise copy of a
// 1xN-tiled tensor): the amaxes of 8 columns live in one vector; a unit of work is one tile
// row of at most 256 columns.
template <int IN, int FMT>
void fq_cols(const FQJob& J, int nthreads) {
    const int64_t mt = (J.m + J.bm - 1) / J.bm;
    const int64_t CW = 256;
    const int64_t ct = (J.k + CW - 1) / CW;
    const int64_t units = mt * ct;
    const float fmax = Fmt<FMT>::MAXF;
    const float rcp = (float)(1.0 / (double)fmax);
#pragma omp parallel num_threads(nthreads)
    {
        alignas(32) float amax[256], m1[256], m2[256], dq[256];
#pragma omp for schedule(dynamic, 1)
        for (int64_t u = 0; u < units; ++u) {
            const int64_t rb = u / ct, cb = u % ct;
            const int64_t r0 = rb * J.bm, r1 = r0 + J.bm < J.m ? r0 + J.bm : J.m;
            const int64_t c0 = cb * CW, nc = c0 + CW <= J.k ? CW : J.k - c0;
            int64_t c = 0;
#if NF8_SIMD
            for (; c + 8 <= nc; c += 8) {
                __m256 acc = _mm256_setzero_ps();
                for (int64_t r = r0; r < r1; ++r) acc = _mm256_max_ps(abs8(load8<IN>(J.x, r * J.k + c0 + c)), acc);
                _mm256_store_ps(amax + c, acc);
            }
#endif
            for (; c < nc; ++c) {
                float acc = 0.0f;
                for (int64_t r = r0; r < r1; ++r) {
                    float a = std::fabs(load1<IN>(J.x, r * J.k + c0 + c));
                    acc = a > acc ? a : acc;
                }
                amax[c] = acc;
            }
            for (c = 0; c < nc; ++c) tile_factors(J, amax[c], fmax, rcp, &m1[c], &m2[c], &dq[c]);
            for (int64_t r = r0; r < r1; ++r) {
                const int64_t row = r * J.k + c0;
                c = 0;
#if NF8_SIMD
                for (; c + 8 <= nc; c += 8) {
                    __m256 v = _mm256_mul_ps(_mm256_mul_ps(load8<IN>(J.x, row + c), _mm256_load_ps(m1 + c)),
                                             _mm256_load_ps(m2 + c));
                    __m256 d = _mm256_i32gather_ps(J.lut, encode8<FMT>(v), 4);
                    _mm256_storeu_ps(J.out + row + c, _mm256_mul_ps(d, _mm256_load_ps(dq + c)));
                }
#endif
                for (; c < nc; ++c) {
                    float v = (load1<IN>(J.x, row + c) * m1[c]) * m2[c];
                    J.out[row + c] = J.lut[encode1<FMT>(v)] * dq[c];
                }
            }
        }
    }
}

// Per-tensor fake quantization with a given scale; the NaN-ignoring amax of x comes back
// in *amax_out when it is not null (delayed scaling records it in the same pass).
template <int IN, int FMT>
void fq_scaled(const void* x, int64_t n, float scale, float dq, const float* lut, float* out,
               float* amax_out, int nthreads) {
    const int64_t chunk = 1 << 15;
    const int64_t nchunks = (n + chunk - 1) / chunk;
    float result = 0.0f;
#pragma omp parallel num_threads(nthreads)
    {
        float acc = 0.0f;
#pragma omp for schedule(dynamic, 2)
        for (int64_t c = 0; c < nchunks; ++c) {
            const int64_t i = c * chunk, len = i + chunk <= n ? chunk : n - i;
            if (amax_out) acc = span_amax<IN>(x, i, len, acc);
            span_fq<IN, FMT>(x, i, len, scale, 1.0f, dq, lut, out);
        }
#pragma omp critical
        result = acc > result ? acc : result;
    }
    if (amax_out) *amax_out = result;
}

// ---------------------------------------------------------------------------------------
// NVFP4 (numerics/nvfp4.py): E2M1 elements, an E4M3 decode scale per 1x16 group or 16x16
// tile, an fp32 global scale. Amaxes propagate NaN (torch.amax), as the reference.

constexpr float FLT_MAX_F = 3.4028234663852886e38f;
const float E2M1_GRID[8] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f};

// NaN-propagating max |x| over [i, i + n), folded into acc (NaN once seen stays NaN).
template <int IN>
inline float span_amax_nan(const void* x, int64_t i, int64_t n, float acc) {
    int64_t j = 0;
    bool nan = std::isnan(acc);
#if NF8_SIMD
    if (n >= 8) {
        __m256 va = _mm256_setzero_ps(), vn = _mm256_setzero_ps();
        for (; j + 8 <= n; j += 8) {
            __m256 a = abs8(load8<IN>(x, i + j));
            vn = _mm256_or_ps(vn, _mm256_cmp_ps(a, a, _CMP_UNORD_Q));
            va = _mm256_max_ps(a, va);
        }
        if (_mm256_movemask_ps(vn)) nan = true;
        float m = hmax8(va);
        if (!nan) acc = m > acc ? m : acc;
    }
#endif
    for (; j < n; ++j) {
        float a = std::fabs(load1<IN>(x, i + j));
        if (std::isnan(a)) nan = true;
        else if (!nan) acc = a > acc ? a : acc;
    }
    return nan ? std::nanf("") : acc;
}

// E2M1 code (sign in bit 3) of v = x * enc, clamped to +-6; u: the uniform draw (SR) or < 0.
inline uint32_t e2m1_code(float v, float u, bool sr) {
    if (v > 6.0f) v = 6.0f;
    if (v < -6.0f) v = -6.0f;
    const float a = std::fabs(v);
    uint32_t mag = 0;
    if (!sr) {
        mag = (a > 0.25f) + (a >= 0.75f) + (a > 1.25f) + (a >= 1.75f) + (a > 2.5f) + (a >= 3.5f) + (a > 5.0f);
    } else {
        uint32_t lo = 0;
        for (int g = 1; g < 8; ++g) lo += a >= E2M1_GRID[g];
        const uint32_t hi = lo + 1 > 7 ? 7 : lo + 1;
        const float gap = E2M1_GRID[hi] - E2M1_GRID[lo];
        const float p = gap > 0.0f ? (a - E2M1_GRID[lo]) / gap : 0.0f;
        mag = lo + (u < p ? 1 : 0);
        if (std::isnan(a)) mag = 0;
    }
    return mag | (v < 0.0f ? 8u : 0u);
}

#if NF8_SIMD
// Eight codes (int32 lanes) of v = x * enc; u8: the uniform draws (SR only).
inline __m256i e2m1_code8(__m256 v, __m256 u8, bool sr) {
    const __m256 six = _mm256_set1_ps(6.0f);
    // min/max with the constant first: a NaN lane stays NaN (the second operand is returned)
    __m256 c = _mm256_max_ps(_mm256_set1_ps(-6.0f), _mm256_min_ps(six, v));
    __m256 a = abs8(c);
    __m256i mag;
    if (!sr) {
        __m256i m = _mm256_setzero_si256();
        m = _mm256_sub_epi32(m, _mm256_castps_si256(_mm256_cmp_ps(a, _mm256_set1_ps(0.25f), _CMP_GT_OQ)));
        m = _mm256_sub_epi32(m, _mm256_castps_si256(_mm256_cmp_ps(a, _mm256_set1_ps(0.75f), _CMP_GE_OQ)));
        m = _mm256_sub_epi32(m, _mm256_castps_si256(_mm256_cmp_ps(a, _mm256_set1_ps(1.25f), _CMP_GT_OQ)));
        m = _mm256_sub_epi32(m, _mm256_castps_si256(_mm256_cmp_ps(a, _mm256_set1_ps(1.75f), _CMP_GE_OQ)));
        m = _mm256_sub_epi32(m, _mm256_castps_si256(_mm256_cmp_ps(a, _mm256_set1_ps(2.5f), _CMP_GT_OQ)));
        m = _mm256_sub_epi32(m, _mm256_castps_si256(_mm256_cmp_ps(a, _mm256_set1_ps(3.5f), _CMP_GE_OQ)));
        m = _mm256_sub_epi32(m, _mm256_castps_si256(_mm256_cmp_ps(a, _mm256_set1_ps(5.0f), _CMP_GT_OQ)));
        mag = m;
    } else {
        __m256i lo = _mm256_setzero_si256();
        for (int g = 1; g < 8; ++g)
            lo = _mm256_sub_epi32(lo, _mm256_castps_si256(_mm256_cmp_ps(a, _mm256_set1_ps(E2M1_GRID[g]), _CMP_GE_OQ)));
        __m256i hi = _mm256_min_epi32(_mm256_add_epi32(lo, _mm256_set1_epi32(1)), _mm256_set1_epi32(7));
        __m256 lov = _mm256_i32gather_ps(E2M1_GRID, lo, 4), hiv = _mm256_i32gather_ps(E2M1_GRID, hi, 4);
        __m256 gap = _mm256_sub_ps(hiv, lov);
        __m256 pos = _mm256_cmp_ps(gap, _mm256_setzero_ps(), _CMP_GT_OQ);
        __m256 safe = _mm256_blendv_ps(_mm256_set1_ps(1.0f), gap, pos);
        __m256 p = _mm256_and_ps(_mm256_div_ps(_mm256_sub_ps(a, lov), safe), pos);
        // NaN lanes: lo = 0 and u < NaN is false, so the magnitude is 0
        mag = _mm256_sub_epi32(lo, _mm256_castps_si256(_mm256_cmp_ps(u8, p, _CMP_LT_OQ)));
    }
    __m256i neg = _mm256_castps_si256(_mm256_cmp_ps(c, _mm256_setzero_ps(), _CMP_LT_OQ));
    return _mm256_or_si256(mag, _mm256_and_si256(neg, _mm256_set1_epi32(8)));
}
#endif

struct NVJob {
    const void* x;
    int64_t m, k;
    int bm;
    float mult, gdec;     // global_encode * fp32(1/6); 1 / global_encode
    const float* u;       // [m, k] uniform draws (stochastic rounding) or null
    uint8_t* packed;      // [m, k/2] or null
    uint8_t* scales;      // E4M3 [ceil(m/bm), k/16] or null
    float* deq;           // [m, k] fake-quantized fp32 or null
    const float* e4lut;   // E4M3 byte -> fp32 (torch's conversion)
};

const float E2M1_LUT[16] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f,
                            -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};

template <int IN>
void nvfp4_tiles(const NVJob& J, int nthreads) {
    const int64_t mt = (J.m + J.bm - 1) / J.bm, kt = J.k / 16;
    const int64_t per_unit = (int64_t)J.bm * J.k;
    const int chunk = (int)(per_unit >= 65536 ? 1 : 65536 / (per_unit > 0 ? per_unit : 1));
#pragma omp parallel num_threads(nthreads)
    {
        std::vector<float> vmax(kt), enc(kt), fac(kt);
#pragma omp for schedule(dynamic, chunk)
        for (int64_t rb = 0; rb < mt; ++rb) {
            const int64_t r0 = rb * J.bm, r1 = r0 + J.bm < J.m ? r0 + J.bm : J.m;
            for (int64_t t = 0; t < kt; ++t) vmax[t] = 0.0f;
            for (int64_t r = r0; r < r1; ++r)
                for (int64_t t = 0; t < kt; ++t) vmax[t] = span_amax_nan<IN>(J.x, r * J.k + t * 16, 16, vmax[t]);
            for (int64_t t = 0; t < kt; ++t) {
                float d = vmax[t] * J.mult;
                if (d > FLT_MAX_F) d = FLT_MAX_F;
                if (d > 448.0f) d = 448.0f;
                if (d < -448.0f) d = -448.0f;
                uint8_t byte = std::isnan(d) ? (uint8_t)0x7F : encode1<0>(d);
                if (J.scales) J.scales[rb * kt + t] = byte;
                const float denom = J.e4lut[byte] * J.gdec;
                float e = 1.0f / denom;
                if (e > FLT_MAX_F) e = FLT_MAX_F;
                enc[t] = e;
                fac[t] = denom;
            }
            alignas(32) int32_t codes[16];
            for (int64_t r = r0; r < r1; ++r)
                for (int64_t t = 0; t < kt; ++t) {
                    const int64_t i = r * J.k + t * 16;
#if NF8_SIMD
                    const __m256 ve = _mm256_set1_ps(enc[t]);
                    for (int h = 0; h < 2; ++h) {
                        __m256 v = _mm256_mul_ps(load8<IN>(J.x, i + 8 * h), ve);
                        __m256 u8 = J.u ? _mm256_loadu_ps(J.u + i + 8 * h) : _mm256_setzero_ps();
                        __m256i cd = e2m1_code8(v, u8, J.u != nullptr);
                        _mm256_store_si256(reinterpret_cast<__m256i*>(codes + 8 * h), cd);
                        if (J.deq)
                            _mm256_storeu_ps(J.deq + i + 8 * h,
                                             _mm256_mul_ps(_mm256_i32gather_ps(E2M1_LUT, cd, 4), _mm256_set1_ps(fac[t])));
                    }
#else
                    for (int j = 0; j < 16; ++j) {
                        float v = load1<IN>(J.x, i + j) * enc[t];
                        codes[j] = (int32_t)e2m1_code(v, J.u ? J.u[i + j] : 0.0f, J.u != nullptr);
                        if (J.deq) J.deq[i + j] = E2M1_LUT[codes[j]] * fac[t];
                    }
#endif
                    if (J.packed)
                        for (int j = 0; j < 8; ++j)
                            J.packed[i / 2 + j] = (uint8_t)(codes[2 * j] | (codes[2 * j + 1] << 4));
                }
        }
    }
}

template <int IN>
float amax_all_nan(const void* x, int64_t n, int nthreads) {
    const int64_t chunk = 1 << 16;
    const int64_t nchunks = (n + chunk - 1) / chunk;
    float result = 0.0f;
    bool nan = false;
#pragma omp parallel num_threads(nthreads)
    {
        float acc = 0.0f;
#pragma omp for schedule(dynamic, 4)
        for (int64_t c = 0; c < nchunks; ++c) {
            const int64_t i = c * chunk;
            acc = span_amax_nan<IN>(x, i, i + chunk <= n ? chunk : n - i, acc);
        }
#pragma omp critical
        {
            if (std::isnan(acc)) nan = true;
            else result = acc > result ? acc : result;
        }
    }
    return nan ? std::nanf("") : result;
}

}  // namespace

extern "C" {

int nf8_abi_version() { return 3; }
int nf8_simd_width() { return NF8_SIMD ? 8 : 1; }

// Block scaling (mx == 0: fp32 scale_inv [batch, ceil(m/bm), ceil(k/bn)]) or MXFP8 (mx == 1:
// E8M0 bytes in e_out, same layout) of a contiguous [batch, m, k] tensor; panel_bytes <= 0
// picks the default panel size. Returns 0 on success.
int nf8_tiles(const void* x, int in_dtype, int64_t batch, int64_t m, int64_t k, int bm, int bn,
              int fmt, int mx, int pow2, int eps_on, float eps, float vinf, uint8_t* out,
              float* scale_inv, uint8_t* e_out, int nthreads, int64_t panel_bytes) {
    if (bm < 1 || bn < 1 || m < 0 || k < 0 || batch < 0 || nthreads < 1) return 2;
    Job J{x, batch, m, k, bm, bn, mx, pow2, eps_on, eps, vinf, out, scale_inv, e_out, panel_bytes};
    const int sel = in_dtype * 2 + fmt;
    switch (sel) {
        case 0: tiles<IN_F32, 0>(J, nthreads); return 0;
        case 1: tiles<IN_F32, 1>(J, nthreads); return 0;
        case 2: tiles<IN_BF16, 0>(J, nthreads); return 0;
        case 3: tiles<IN_BF16, 1>(J, nthreads); return 0;
        case 4: tiles<IN_F16, 0>(J, nthreads); return 0;
        case 5: tiles<IN_F16, 1>(J, nthreads); return 0;
    }
    return 1;
}

// NaN-ignoring max |x| of n contiguous elements into *out.
int nf8_amax(const void* x, int in_dtype, int64_t n, float* out, int nthreads) {
    if (n < 0 || nthreads < 1) return 2;
    switch (in_dtype) {
        case IN_F32: *out = amax_all<IN_F32>(x, n, nthreads); return 0;
        case IN_BF16: *out = amax_all<IN_BF16>(x, n, nthreads); return 0;
        case IN_F16: *out = amax_all<IN_F16>(x, n, nthreads); return 0;
    }
    return 1;
}

// out = sat_cast(x * scale) for n contiguous elements (per-tensor scaling's cast).
int nf8_scaled_cast(const void* x, int in_dtype, int64_t n, float scale, int fmt, uint8_t* out,
                    int nthreads) {
    if (n < 0 || nthreads < 1) return 2;
    const int sel = in_dtype * 2 + fmt;
    switch (sel) {
        case 0: cast_all<IN_F32, 0>(x, n, scale, out, nthreads); return 0;
        case 1: cast_all<IN_F32, 1>(x, n, scale, out, nthreads); return 0;
        case 2: cast_all<IN_BF16, 0>(x, n, scale, out, nthreads); return 0;
        case 3: cast_all<IN_BF16, 1>(x, n, scale, out, nthreads); return 0;
        case 4: cast_all<IN_F16, 0>(x, n, scale, out, nthreads); return 0;
        case 5: cast_all<IN_F16, 1>(x, n, scale, out, nthreads); return 0;
    }
    return 1;
}

// Fake quantization of a contiguous [m, k] tensor with bm x bn tiles: block scaling (mx == 0)
// or MXFP8 (mx == 1); fp32 result in out. lut: the format's 256 float8 -> fp32 values;
// e8lut: the 256 E8M0 -> fp32 values (MXFP8).
int nf8_fake_quant_tiles(const void* x, int in_dtype, int64_t m, int64_t k, int bm, int bn,
                         int fmt, int mx, int pow2, int eps_on, float eps, float vinf,
                         const float* lut, const float* e8lut, float* out, int nthreads) {
    if (bm < 1 || bn < 1 || m < 0 || k < 0 || nthreads < 1) return 2;
    FQJob J{x, m, k, bm, bn, mx, pow2, eps_on, eps, vinf, out, lut, e8lut};
    const int sel = in_dtype * 2 + fmt;
    const bool cols = bn == 1;
#define NF8_FQ(I, F) (cols ? fq_cols<I, F>(J, nthreads) : fq_rows<I, F>(J, nthreads))
    switch (sel) {
        case 0: NF8_FQ(IN_F32, 0); return 0;
        case 1: NF8_FQ(IN_F32, 1); return 0;
        case 2: NF8_FQ(IN_BF16, 0); return 0;
        case 3: NF8_FQ(IN_BF16, 1); return 0;
        case 4: NF8_FQ(IN_F16, 0); return 0;
        case 5: NF8_FQ(IN_F16, 1); return 0;
    }
#undef NF8_FQ
    return 1;
}

// Per-tensor fake quantization: out = lut[code(x * scale)] * scale_inv for n elements; the
// NaN-ignoring amax of x into *amax_out when not null.
int nf8_fake_quant_scaled(const void* x, int in_dtype, int64_t n, float scale, float scale_inv,
                          int fmt, const float* lut, float* out, float* amax_out, int nthreads) {
    if (n < 0 || nthreads < 1) return 2;
    const int sel = in_dtype * 2 + fmt;
    switch (sel) {
        case 0: fq_scaled<IN_F32, 0>(x, n, scale, scale_inv, lut, out, amax_out, nthreads); return 0;
        case 1: fq_scaled<IN_F32, 1>(x, n, scale, scale_inv, lut, out, amax_out, nthreads); return 0;
        case 2: fq_scaled<IN_BF16, 0>(x, n, scale, scale_inv, lut, out, amax_out, nthreads); return 0;
        case 3: fq_scaled<IN_BF16, 1>(x, n, scale, scale_inv, lut, out, amax_out, nthreads); return 0;
        case 4: fq_scaled<IN_F16, 0>(x, n, scale, scale_inv, lut, out, amax_out, nthreads); return 0;
        case 5: fq_scaled<IN_F16, 1>(x, n, scale, scale_inv, lut, out, amax_out, nthreads); return 0;
    }
    return 1;
}

// TE's scale from an amax (scaling.scale_from_amax) and its correctly rounded inverse.
int nf8_scale_from_amax(float amax, float fmax, int pow2, int eps_on, float eps, float vinf,
                        float* scale, float* scale_inv) {
    *scale = scale_from_amax(amax, fmax, pow2, eps_on, eps, vinf);
    *scale_inv = reciprocal(*scale);
    return 0;
}

// NaN-propagating max |x| (NVFP4's global amax; torch.amax semantics).
int nf8_amax_nan(const void* x, int in_dtype, int64_t n, float* out, int nthreads) {
    if (n < 0 || nthreads < 1) return 2;
    switch (in_dtype) {
        case IN_F32: *out = amax_all_nan<IN_F32>(x, n, nthreads); return 0;
        case IN_BF16: *out = amax_all_nan<IN_BF16>(x, n, nthreads); return 0;
        case IN_F16: *out = amax_all_nan<IN_F16>(x, n, nthreads); return 0;
    }
    return 1;
}

// NVFP4 of a contiguous [m, k] tensor (k a multiple of 16), bm = 1 or 16, given the global
// amax: packed E2M1 codes, E4M3 scales and/or the fp32 fake-quantized values (any pointer
// may be null). u: uniform draws for stochastic rounding, or null for round to nearest.
int nf8_nvfp4(const void* x, int in_dtype, int64_t m, int64_t k, int bm, float global_amax,
              const float* u, const float* e4lut, uint8_t* packed, uint8_t* scales, float* deq,
              int nthreads) {
    if ((bm != 1 && bm != 16) || m < 0 || k < 0 || k % 16 || nthreads < 1) return 2;
    // nvfp4_global_encode_scale: fp32 2688 / amax, capped at FLT_MAX, 0 -> 1 (NaN stays)
    float genc = 2688.0f / global_amax;
    if (genc > FLT_MAX_F) genc = FLT_MAX_F;
    if (genc == 0.0f) genc = 1.0f;
    const float gdec = 1.0f / genc;
    const float one_sixth = 1.0f / 6.0f;
    NVJob J{x, m, k, bm, genc * one_sixth, gdec, u, packed, scales, deq, e4lut};
    switch (in_dtype) {
        case IN_F32: nvfp4_tiles<IN_F32>(J, nthreads); return 0;
        case IN_BF16: nvfp4_tiles<IN_BF16>(J, nthreads); return 0;
        case IN_F16: nvfp4_tiles<IN_F16>(J, nthreads); return 0;
    }
    return 1;
}

}  // extern "C"
