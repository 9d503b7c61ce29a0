/* The reference's byte decoders and FP8 rounding, for CPU tensors (harness/quant/native.py).
 *
 * Each function computes exactly what the plain-torch path computes: a code's float32 value,
 * then at most one float32 multiply by its scale; or the round-to-nearest-even of a float32 to
 * the float8_e4m3fn grid. Built with -ffp-contract=off, so that no multiply is fused into an
 * add: the values are bit-identical to torch's on every CPU. With AVX-512 the main loops take
 * 16 values at a time (a 16-entry code table fits one register), with AVX2 8 (two 8-entry
 * halves); the scalar loops are the definition and finish what the vector loops leave.
 */
#include <stdint.h>
#include <string.h>
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

/* Values a vector loop takes at a time: 16 with AVX-512, 8 with AVX2, else 1 (scalar loops only). */
int harness_vector_width(void) {
#if defined(__AVX512F__)
    return 16;
#elif defined(__AVX2__)
    return 8;
#else
    return 1;
#endif
}

static inline float from_bits(uint32_t b) { float f; memcpy(&f, &b, 4); return f; }
static inline uint32_t to_bits(float f) { uint32_t b; memcpy(&b, &f, 4); return b; }

/* float32 of a float8_e4m3fn byte, as torch's cast gives it (NaN: sign | 0x7ff00000). */
static inline float e4m3(uint8_t code) {
    uint32_t sign = (uint32_t)(code & 0x80) << 24, mag = code & 0x7f;
    if (mag == 0x7f)
        return from_bits(sign | 0x7ff00000u);
    if (mag < 8)  /* subnormal: mag * 2^-9, exact */
        return from_bits(sign | to_bits((float)mag * 0x1p-9f));
    return from_bits(sign | ((mag << 20) + (120u << 23)));  /* rebias the exponent: 7 -> 127 */
}

#if defined(__AVX512F__)
static inline __m512 e4m3_x16(__m128i bytes) {
    __m512i b = _mm512_cvtepu8_epi32(bytes);
    __m512i mag = _mm512_and_si512(b, _mm512_set1_epi32(0x7f));
    __m512i sign = _mm512_slli_epi32(_mm512_and_si512(b, _mm512_set1_epi32(0x80)), 24);
    __m512i value = _mm512_add_epi32(_mm512_slli_epi32(mag, 20), _mm512_set1_epi32(120 << 23));
    __m512 sub = _mm512_mul_ps(_mm512_cvtepi32_ps(mag), _mm512_set1_ps(0x1p-9f));
    value = _mm512_mask_mov_epi32(value, _mm512_cmplt_epu32_mask(mag, _mm512_set1_epi32(8)), _mm512_castps_si512(sub));
    value = _mm512_mask_mov_epi32(value, _mm512_cmpeq_epi32_mask(mag, _mm512_set1_epi32(0x7f)), _mm512_set1_epi32(0x7ff00000));
    return _mm512_castsi512_ps(_mm512_or_si512(value, sign));
}
#elif defined(__AVX2__)
static inline __m256 e4m3_x8(const uint8_t *codes) {
    __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)codes));
    __m256i mag = _mm256_and_si256(b, _mm256_set1_epi32(0x7f));
    __m256i sign = _mm256_slli_epi32(_mm256_and_si256(b, _mm256_set1_epi32(0x80)), 24);
    __m256i value = _mm256_add_epi32(_mm256_slli_epi32(mag, 20), _mm256_set1_epi32(120 << 23));
    __m256 sub = _mm256_mul_ps(_mm256_cvtepi32_ps(mag), _mm256_set1_ps(0x1p-9f));
    value = _mm256_blendv_epi8(value, _mm256_castps_si256(sub), _mm256_cmpgt_epi32(_mm256_set1_epi32(8), mag));
    value = _mm256_blendv_epi8(value, _mm256_set1_epi32(0x7ff00000), _mm256_cmpeq_epi32(mag, _mm256_set1_epi32(0x7f)));
    return _mm256_castsi256_ps(_mm256_or_si256(value, sign));
}

/* code16[idx] for 8 indices below 16: an 8-entry permute of each half, chosen by the index's bit 3. */
static inline __m256 lookup16_x8(__m256 low_half, __m256 high_half, __m256i idx) {
    __m256 from_high = _mm256_castsi256_ps(_mm256_slli_epi32(idx, 28));  /* bit 3 into the sign bit */
    return _mm256_blendv_ps(_mm256_permutevar8x32_ps(low_half, idx), _mm256_permutevar8x32_ps(high_half, idx),
                            from_high);
}
#endif

/* out[i] = e4m3(c) * scales[i / group], c = codes[i], or remap[codes[i]] with a remap (a fused
 * shard's requantized codes); one scale per tensor: group = n. */
void harness_decode_e4m3(const uint8_t *codes, int64_t n, const uint8_t *remap, const float *scales,
                         int64_t group, float *out) {
    float table[256];
    for (int c = 0; c < 256; c++)
        table[c] = e4m3(remap ? remap[c] : (uint8_t)c);
    for (int64_t start = 0; start < n; start += group) {
        int64_t stop = n - start < group ? n : start + group, i = start;
        float s = scales[start / group];
#if defined(__AVX512F__)
        __m512 vs = _mm512_set1_ps(s);
        for (; !remap && i + 16 <= stop; i += 16)
            _mm512_storeu_ps(out + i, _mm512_mul_ps(e4m3_x16(_mm_loadu_si128((const __m128i *)(codes + i))), vs));
#elif defined(__AVX2__)
        __m256 vs = _mm256_set1_ps(s);
        for (; !remap && i + 8 <= stop; i += 8)
            _mm256_storeu_ps(out + i, _mm256_mul_ps(e4m3_x8(codes + i), vs));
#endif
        for (; i < stop; i++)
            out[i] = table[codes[i]] * s;
    }
}

/* out[i] = float32(codes[i]) * scales[i / group] for int8 codes (one scale per tensor: group = n). */
void harness_decode_int8(const int8_t *codes, int64_t n, const float *scales, int64_t group, float *out) {
    for (int64_t start = 0; start < n; start += group) {
        int64_t stop = n - start < group ? n : start + group, i = start;
        float s = scales[start / group];
#if defined(__AVX512F__)
        __m512 vs = _mm512_set1_ps(s);
        for (; i + 16 <= stop; i += 16) {
            __m512i q = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(codes + i)));
            _mm512_storeu_ps(out + i, _mm512_mul_ps(_mm512_cvtepi32_ps(q), vs));
        }
#elif defined(__AVX2__)
        __m256 vs = _mm256_set1_ps(s);
        for (; i + 8 <= stop; i += 8) {
            __m256i q = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(codes + i)));
            _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_cvtepi32_ps(q), vs));
        }
#endif
        for (; i < stop; i++)
            out[i] = (float)codes[i] * s;
    }
}

/* bitsandbytes 4-bit: byte i holds codes 2i (high nibble) and 2i+1 (low); out[2i + k] =
 * code16[nibble] * scales[i / group], for nbytes bytes (group: bytes per absmax block). */
void harness_decode_nibbles(const float *code16, const uint8_t *packed, int64_t nbytes, const float *scales,
                            int64_t group, float *out) {
#if defined(__AVX512F__)
    __m512 table = _mm512_loadu_ps(code16);
    __m128i low4 = _mm_set1_epi8(0x0f);
#elif defined(__AVX2__)
    __m256 low_half = _mm256_loadu_ps(code16), high_half = _mm256_loadu_ps(code16 + 8);
    __m128i low4 = _mm_set1_epi8(0x0f);
#endif
    for (int64_t start = 0; start < nbytes; start += group) {
        int64_t stop = nbytes - start < group ? nbytes : start + group, i = start;
        float s = scales[start / group];
#if defined(__AVX512F__)
        __m512 vs = _mm512_set1_ps(s);
        for (; i + 16 <= stop; i += 16) {
            __m128i v = _mm_loadu_si128((const __m128i *)(packed + i));
            __m128i hi = _mm_and_si128(_mm_srli_epi16(v, 4), low4), lo = _mm_and_si128(v, low4);
            __m128i first = _mm_unpacklo_epi8(hi, lo), second = _mm_unpackhi_epi8(hi, lo);  /* code order */
            _mm512_storeu_ps(out + 2 * i, _mm512_mul_ps(_mm512_permutexvar_ps(_mm512_cvtepu8_epi32(first), table), vs));
            _mm512_storeu_ps(out + 2 * i + 16, _mm512_mul_ps(_mm512_permutexvar_ps(_mm512_cvtepu8_epi32(second), table), vs));
        }
#elif defined(__AVX2__)
        __m256 vs = _mm256_set1_ps(s);
        for (; i + 8 <= stop; i += 8) {
            __m128i v = _mm_loadl_epi64((const __m128i *)(packed + i));
            __m128i hi = _mm_and_si128(_mm_srli_epi16(v, 4), low4), lo = _mm_and_si128(v, low4);
            __m128i order = _mm_unpacklo_epi8(hi, lo);  /* the 16 codes of 8 bytes, in code order */
            __m256i first = _mm256_cvtepu8_epi32(order), second = _mm256_cvtepu8_epi32(_mm_srli_si128(order, 8));
            _mm256_storeu_ps(out + 2 * i, _mm256_mul_ps(lookup16_x8(low_half, high_half, first), vs));
            _mm256_storeu_ps(out + 2 * i + 8, _mm256_mul_ps(lookup16_x8(low_half, high_half, second), vs));
        }
#endif
        for (; i < stop; i++) {
            out[2 * i] = code16[packed[i] >> 4] * s;
            out[2 * i + 1] = code16[packed[i] & 0x0f] * s;
        }
    }
}

/* out[i] = float32(float8_e4m3fn(x[i])) for x within +-448 (or NaN), rounded to nearest even:
 * torch's `x.to(torch.float8_e4m3fn).float()`. */
void harness_round_e4m3(const float *x, int64_t n, float *out) {
    for (int64_t i = 0; i < n; i++) {
        uint32_t bits = to_bits(x[i]);
        uint32_t sign = bits & 0x80000000u, mag = bits ^ sign;
        if (mag > 0x7f800000u) {             /* NaN: code 0x7f, its sign kept */
            out[i] = from_bits(sign | 0x7ff00000u);
            continue;
        }
        if (mag < 0x3c800000u) {             /* below 2^-6 the step is 2^-9 (subnormals) */
            /* in [2^14, 2^15) a float32's step is 2^-9: the sum rounds to it, ties to even */
            mag = to_bits((from_bits(mag) + 16384.0f) - 16384.0f);
        } else {                             /* normal: keep 3 of 23 mantissa bits, ties to even */
            mag += 0x7ffffu + ((mag >> 20) & 1u);
            mag &= 0xfff00000u;
        }
        out[i] = from_bits(sign | mag);
    }
}
