// Reference layer ops: plain loops over NHWC activations and Keras kernel
// layouts, templated on the scalar type so that tests can run them in double
// precision (tight finite-difference checks) and compare other backends
// against them. Clarity over speed; single-threaded; no allocation.
//
// Conventions shared by every op: `batch` examples; activations are
// [batch, h, w, c] row-major using the shapes in the LayerDef (filled by
// ParseModel); a Conv2D kernel is [k, k, in.c, filters], a Dense kernel is
// [in.c, units]; biases are [units]. Backward ops ADD into d_kernel/d_bias
// (callers zero them) and OVERWRITE d_in; d_in may be null when the input
// gradient is not needed. ReLU is applied by the separate Relu* ops.
#ifndef PSFLOW_WORKER_CPU_REFERENCE_OPS_H_
#define PSFLOW_WORKER_CPU_REFERENCE_OPS_H_

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "worker/model/model_def.h"

namespace psflow::worker::reference {

// out = conv(in, kernel) + bias (no relu).
template <typename T>
void Conv2DForward(const LayerDef& l, int batch, const T* in, const T* kernel, const T* bias,
                   T* out) {
  const Shape3 is = l.input, os = l.output;
  const int k = l.kernel, s = l.stride, pt = PadTop(l), pl = PadLeft(l), f_n = os.c;
  for (int b = 0; b < batch; ++b) {
    const T* x = in + b * is.size();
    for (int oh = 0; oh < os.h; ++oh) {
      for (int ow = 0; ow < os.w; ++ow) {
        T* y = out + b * os.size() + (int64_t{oh} * os.w + ow) * f_n;
        for (int f = 0; f < f_n; ++f) y[f] = bias[f];
        for (int kh = 0; kh < k; ++kh) {
          const int ih = oh * s + kh - pt;
          if (ih < 0 || ih >= is.h) continue;
          for (int kw = 0; kw < k; ++kw) {
            const int iw = ow * s + kw - pl;
            if (iw < 0 || iw >= is.w) continue;
            const T* xp = x + (int64_t{ih} * is.w + iw) * is.c;
            const T* kp = kernel + (int64_t{kh} * k + kw) * is.c * f_n;
            for (int c = 0; c < is.c; ++c) {
              const T xv = xp[c];
              const T* kc = kp + int64_t{c} * f_n;
              for (int f = 0; f < f_n; ++f) y[f] += xv * kc[f];
            }
          }
        }
      }
    }
  }
}

// d_out is the gradient with respect to the pre-relu output.
template <typename T>
void Conv2DBackward(const LayerDef& l, int batch, const T* in, const T* kernel, const T* d_out,
                    T* d_in, T* d_kernel, T* d_bias) {
  const Shape3 is = l.input, os = l.output;
  const int k = l.kernel, s = l.stride, pt = PadTop(l), pl = PadLeft(l), f_n = os.c;
  if (d_in != nullptr) std::fill(d_in, d_in + batch * is.size(), T{0});
  for (int b = 0; b < batch; ++b) {
    const T* x = in + b * is.size();
    T* dx = d_in != nullptr ? d_in + b * is.size() : nullptr;
    for (int oh = 0; oh < os.h; ++oh) {
      for (int ow = 0; ow < os.w; ++ow) {
        const T* dy = d_out + b * os.size() + (int64_t{oh} * os.w + ow) * f_n;
        for (int f = 0; f < f_n; ++f) d_bias[f] += dy[f];
        for (int kh = 0; kh < k; ++kh) {
          const int ih = oh * s + kh - pt;
          if (ih < 0 || ih >= is.h) continue;
          for (int kw = 0; kw < k; ++kw) {
            const int iw = ow * s + kw - pl;
            if (iw < 0 || iw >= is.w) continue;
            const int64_t in_off = (int64_t{ih} * is.w + iw) * is.c;
            const int64_t k_off = (int64_t{kh} * k + kw) * is.c * f_n;
            for (int c = 0; c < is.c; ++c) {
              const T xv = x[in_off + c];
              const T* kc = kernel + k_off + int64_t{c} * f_n;
              T* dkc = d_kernel + k_off + int64_t{c} * f_n;
              T acc{0};
              for (int f = 0; f < f_n; ++f) {
                dkc[f] += xv * dy[f];
                acc += kc[f] * dy[f];
              }
              if (dx != nullptr) dx[in_off + c] += acc;
            }
          }
        }
      }
    }
  }
}

// The input index (within one example) that a max-pool output reads: the
// first maximum in row-major scan order of the window, padding ignored (TF).
template <typename T>
int64_t MaxPoolArgMax(const LayerDef& l, const T* x, int oh, int ow, int c) {
  const Shape3 is = l.input;
  const int h0 = oh * l.stride - PadTop(l), w0 = ow * l.stride - PadLeft(l);
  int64_t best = -1;
  for (int ih = std::max(h0, 0); ih < std::min(h0 + l.kernel, is.h); ++ih) {
    for (int iw = std::max(w0, 0); iw < std::min(w0 + l.kernel, is.w); ++iw) {
      const int64_t idx = (int64_t{ih} * is.w + iw) * is.c + c;
      if (best < 0 || x[idx] > x[best]) best = idx;
    }
  }
  return best;  // >= 0: TF's same padding never leaves a window empty
}

template <typename T>
void MaxPoolForward(const LayerDef& l, int batch, const T* in, T* out) {
  const Shape3 is = l.input, os = l.output;
  for (int b = 0; b < batch; ++b) {
    const T* x = in + b * is.size();
    T* y = out + b * os.size();
    for (int oh = 0; oh < os.h; ++oh) {
      for (int ow = 0; ow < os.w; ++ow) {
        for (int c = 0; c < os.c; ++c) {
          y[(int64_t{oh} * os.w + ow) * os.c + c] = x[MaxPoolArgMax(l, x, oh, ow, c)];
        }
      }
    }
  }
}

// Routes each output gradient to the one input element MaxPoolArgMax picks.
template <typename T>
void MaxPoolBackward(const LayerDef& l, int batch, const T* in, const T* d_out, T* d_in) {
  const Shape3 is = l.input, os = l.output;
  std::fill(d_in, d_in + batch * is.size(), T{0});
  for (int b = 0; b < batch; ++b) {
    const T* x = in + b * is.size();
    const T* dy = d_out + b * os.size();
    T* dx = d_in + b * is.size();
    for (int oh = 0; oh < os.h; ++oh) {
      for (int ow = 0; ow < os.w; ++ow) {
        for (int c = 0; c < os.c; ++c) {
          dx[MaxPoolArgMax(l, x, oh, ow, c)] += dy[(int64_t{oh} * os.w + ow) * os.c + c];
        }
      }
    }
  }
}

// out = in @ kernel + bias (no relu); in is [batch, l.input.c] (flattened).
template <typename T>
void DenseForward(const LayerDef& l, int batch, const T* in, const T* kernel, const T* bias,
                  T* out) {
  const int n_in = l.input.c, n_out = l.units;
  for (int b = 0; b < batch; ++b) {
    const T* x = in + int64_t{b} * n_in;
    T* y = out + int64_t{b} * n_out;
    for (int u = 0; u < n_out; ++u) y[u] = bias[u];
    for (int i = 0; i < n_in; ++i) {
      const T xv = x[i];
      const T* w = kernel + int64_t{i} * n_out;
      for (int u = 0; u < n_out; ++u) y[u] += xv * w[u];
    }
  }
}

// d_out is the gradient with respect to the pre-relu output.
template <typename T>
void DenseBackward(const LayerDef& l, int batch, const T* in, const T* kernel, const T* d_out,
                   T* d_in, T* d_kernel, T* d_bias) {
  const int n_in = l.input.c, n_out = l.units;
  for (int b = 0; b < batch; ++b) {
    const T* x = in + int64_t{b} * n_in;
    const T* dy = d_out + int64_t{b} * n_out;
    for (int u = 0; u < n_out; ++u) d_bias[u] += dy[u];
    for (int i = 0; i < n_in; ++i) {
      const T xv = x[i];
      const T* w = kernel + int64_t{i} * n_out;
      T* dw = d_kernel + int64_t{i} * n_out;
      T acc{0};
      for (int u = 0; u < n_out; ++u) {
        dw[u] += xv * dy[u];
        acc += w[u] * dy[u];
      }
      if (d_in != nullptr) d_in[int64_t{b} * n_in + i] = acc;
    }
  }
}

template <typename T>
void ReluForward(int64_t n, T* x) {
  for (int64_t i = 0; i < n; ++i) x[i] = x[i] > T{0} ? x[i] : T{0};
}

// d *= (out > 0), where out is the relu's output.
template <typename T>
void ReluBackward(int64_t n, const T* out, T* d) {
  for (int64_t i = 0; i < n; ++i) {
    if (!(out[i] > T{0})) d[i] = T{0};
  }
}

// Softmax cross-entropy of `logits` [batch, classes] against `labels`
// (each in [0, classes); the caller checks). Returns the loss summed over the
// batch (log-sum-exp with the max subtracted, accumulated in double); adds
// to *correct the examples whose first arg-max logit equals the label; when
// d_logits is not null writes the gradient of the MEAN loss,
// (softmax - one_hot) / batch.
template <typename T>
double SoftmaxCrossEntropy(int batch, int classes, const T* logits, const int32_t* labels,
                           T* d_logits, int64_t* correct) {
  double loss_sum = 0;
  for (int b = 0; b < batch; ++b) {
    const T* z = logits + int64_t{b} * classes;
    int arg = 0;
    for (int j = 1; j < classes; ++j) {
      if (z[j] > z[arg]) arg = j;
    }
    if (arg == labels[b]) ++*correct;
    const double m = z[arg];
    double sum = 0;
    for (int j = 0; j < classes; ++j) sum += std::exp(double{z[j]} - m);
    const double lse = m + std::log(sum);
    loss_sum += lse - double{z[labels[b]]};
    if (d_logits != nullptr) {
      T* dz = d_logits + int64_t{b} * classes;
      for (int j = 0; j < classes; ++j) {
        const double p = std::exp(double{z[j]} - lse);
        dz[j] = static_cast<T>((p - (j == labels[b] ? 1.0 : 0.0)) / batch);
      }
    }
  }
  return loss_sum;
}

}  // namespace psflow::worker::reference

#endif  // PSFLOW_WORKER_CPU_REFERENCE_OPS_H_
