/* One token of the gated delta rule, fused: the CPU twin of delta_rule._one_token_torch.
 *
 * For each of n rows and h value heads (item = row * h + head), with the state S [dk, dv] read
 * from src at the row's slot and written to dst at the same slot (slots NULL: the row index):
 *
 *     seen  = S^T k                          (dk x dv, a pass over S)
 *     delta = (v - e^g seen) * beta
 *     S'    = e^g S + k delta^T              (a second pass, S still in the core's cache)
 *     o     = S'^T q                         (in the same pass; skipped when out is NULL)
 *
 * Two passes over a 64 KB state where the torch ops make six over the whole batch's states,
 * so the states are read from memory once and written once. src and dst may be the same
 * tensor (the pool, stepped in place); slots must then be distinct. Everything is float32,
 * contiguous: q, k [n, h, dk], v [n, h, dv], g, beta [n, h], src and dst [*, h, dk, dv],
 * out [n, h, dv]. Items run in parallel on the calling thread's OpenMP team (torch's libgomp,
 * already loaded when this library is).
 */
#include <math.h>
#include <stdint.h>

void gdn_one_token(const float *q, const float *k, const float *v, const float *g,
                   const float *beta, const float *src, float *dst, const int64_t *slots,
                   float *out, int64_t n, int64_t h, int64_t dk, int64_t dv)
{
#pragma omp parallel for schedule(static)
    for (int64_t item = 0; item < n * h; item++) {
        int64_t row = item / h, head = item % h;
        int64_t slot = slots ? slots[row] : row;
        const float *s = src + (slot * h + head) * dk * dv;
        float *d = dst + (slot * h + head) * dk * dv;
        const float *kr = k + item * dk;
        const float *vr = v + item * dv;
        float decay = expf(g[item]), b = beta[item];
        float seen[dv], delta[dv];
        for (int64_t j = 0; j < dv; j++)
            seen[j] = 0.0f;
        for (int64_t i = 0; i < dk; i++) {
            const float ki = kr[i], *srow = s + i * dv;
            for (int64_t j = 0; j < dv; j++)
                seen[j] += ki * srow[j];
        }
        for (int64_t j = 0; j < dv; j++)
            delta[j] = (vr[j] - decay * seen[j]) * b;
        if (out == 0) {
            for (int64_t i = 0; i < dk; i++) {
                const float ki = kr[i], *srow = s + i * dv;
                float *drow = d + i * dv;
                for (int64_t j = 0; j < dv; j++)
                    drow[j] = srow[j] * decay + ki * delta[j];
            }
            continue;
        }
        const float *qr = q + item * dk;
        float o[dv];
        for (int64_t j = 0; j < dv; j++)
            o[j] = 0.0f;
        for (int64_t i = 0; i < dk; i++) {
            const float ki = kr[i], qi = qr[i], *srow = s + i * dv;
            float *drow = d + i * dv;
            for (int64_t j = 0; j < dv; j++) {
                float x = srow[j] * decay + ki * delta[j];
                drow[j] = x;
                o[j] += qi * x;
            }
        }
        float *orow = out + item * dv;
        for (int64_t j = 0; j < dv; j++)
            orow[j] = o[j];
    }
}
