// The "cpu" backend: the whole model as a fixed list of oneDNN primitives.
//
// Why it is built this way (measured on the 2-core development machines, see
// shared/DESIGN.md and docs/BENCHMARKS.md, "Worker compute (CPU)"):
// * Convolutions are created with format_tag::any so that oneDNN picks its
//   blocked layouts (plain NCHW convolutions were 3-7x slower). Activations
//   stay in whatever layout the producing primitive chose and are reordered
//   only where the consumer wants another one.
// * Dense layers run on oneDNN too (the Debian OpenBLAS falls back to slow
//   kernels on this CPU), but in plain layouts: the caller's Keras kernel is
//   used in place and gradients are written straight into the caller's
//   buffers (see Dense() for the numbers).
// * Every primitive, every intermediate buffer and every reorder is created
//   once per batch size (Prepare builds the max_batch plan, a smaller final
//   batch gets its own plan lazily, kept). A step only points the user
//   memories at this step's params/images/grads and executes the lists.
// * Conv kernels arrive in Keras HWIO layout; they are reordered into the
//   primitive's layout each step (cheap next to the convolution), and their
//   gradients are reordered back into HWIO.
#include <dlfcn.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <memory>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "oneapi/dnnl/dnnl.hpp"
#include "worker/cpu/cpu_backend.h"

namespace psflow::worker {
namespace {

// Debian's oneDNN uses the OpenMP runtime (DNNL_CPU_RUNTIME == OMP). The
// number of threads of a parallel region is a per-thread setting of the
// thread that starts it, so setting it on the calling thread before each
// step is enough. libgomp is loaded by libdnnl; looking the symbol up at run
// time avoids making every target that links us link OpenMP explicitly.
void SetOmpThreads(int threads) {
  using SetFn = void (*)(int);
  static const SetFn set_fn = reinterpret_cast<SetFn>(dlsym(RTLD_DEFAULT, "omp_set_num_threads"));
  if (set_fn != nullptr && threads > 0) set_fn(threads);
}

using Tag = dnnl::memory::format_tag;
using Dims = dnnl::memory::dims;
constexpr auto kF32 = dnnl::memory::data_type::f32;

// The primitives and buffers of one batch size. The user memories (images,
// params, grads) own no buffer: each step points them at the caller's.
struct OneDnnPlan {
  struct Exec {
    dnnl::primitive primitive;
    std::unordered_map<int, dnnl::memory> args;
  };
  dnnl::memory images;               // [batch, h, w, c] as NCHW dims, nhwc tag
  std::vector<dnnl::memory> params;  // per model variable, Keras layout
  std::vector<dnnl::memory> grads;   // per model variable, Keras layout
  // Other views of a variable's buffer: (variable index, memory).
  std::vector<std::pair<int, dnnl::memory>> param_views;
  std::vector<Exec> forward;
  std::vector<Exec> backward;
  dnnl::memory logits;       // [batch, classes], plain
  dnnl::memory diff_logits;  // [batch, classes], plain
};

// What the backward pass needs to know about one forward primitive.
struct ForwardOp {
  const LayerDef* layer = nullptr;
  dnnl::memory src, dst, weights, workspace;
  dnnl::convolution_forward::primitive_desc conv_pd;
  dnnl::inner_product_forward::primitive_desc ip_pd;
  dnnl::pooling_forward::primitive_desc pool_pd;
  Dims strides, kernel, pad_l, pad_r;  // conv and pool
};

// Strides, window and Keras padding ("same" puts the odd pixel at the
// bottom/right, as TensorFlow does) of a Conv2D or MaxPool2D layer, checked
// against the output shape the parser computed.
absl::Status WindowGeometry(const LayerDef& l, ForwardOp* op) {
  const int k = l.kernel, s = l.stride;
  if (k <= 0 || s <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("layer ", l.name, ": kernel ", k, " and stride ", s, " must be positive"));
  }
  op->strides = {s, s};
  op->kernel = {k, k};
  op->pad_l = {0, 0};
  op->pad_r = {0, 0};
  const int in[2] = {l.input.h, l.input.w};
  const int out[2] = {l.output.h, l.output.w};
  for (int d = 0; d < 2; ++d) {
    const int expected = l.same_padding ? (in[d] + s - 1) / s : (in[d] - k) / s + 1;
    if (expected <= 0 || expected != out[d]) {
      return absl::InvalidArgumentError(
          absl::StrCat("layer ", l.name, ": output size ", out[d], " along dimension ", d,
                       " does not match input ", in[d], ", window ", k, ", stride ", s,
                       " (expected ", expected, ")"));
    }
    if (l.same_padding) {
      const int total = std::max((out[d] - 1) * s + k - in[d], 0);
      op->pad_l[d] = total / 2;
      op->pad_r[d] = total - total / 2;
    }
  }
  return absl::OkStatus();
}

dnnl::memory::desc AnyLike(const dnnl::memory::desc& d) {
  return dnnl::memory::desc(d.dims(), kF32, Tag::any);
}

class PlanBuilder {
 public:
  PlanBuilder(const ModelDef& model, int batch, const dnnl::engine& engine)
      : model_(model), batch_(batch), engine_(engine), plan_(std::make_unique<OneDnnPlan>()) {}

  absl::StatusOr<std::unique_ptr<OneDnnPlan>> Build() {
    const size_t num_vars = model_.variables.size();
    plan_->params.resize(num_vars);
    plan_->grads.resize(num_vars);
    const Shape3& in = model_.input;
    plan_->images = UserMemory({batch_, in.c, in.h, in.w}, Tag::nhwc);
    dnnl::memory cur = plan_->images;
    for (const LayerDef& layer : model_.layers) {
      if (layer.input.size() != Elements(cur.get_desc()) / batch_) {
        return absl::InvalidArgumentError(
            absl::StrCat("layer ", layer.name, ": input has ", layer.input.size(),
                         " values per example but the previous layer produces ",
                         Elements(cur.get_desc()) / batch_));
      }
      switch (layer.kind) {
        case LayerKind::kConv2D: {
          PSFLOW_ASSIGN_OR_RETURN(cur, Conv(layer, cur));
          break;
        }
        case LayerKind::kDense: {
          PSFLOW_ASSIGN_OR_RETURN(cur, Dense(layer, cur));
          break;
        }
        case LayerKind::kMaxPool2D: {
          PSFLOW_ASSIGN_OR_RETURN(cur, Pool(layer, cur));
          break;
        }
        case LayerKind::kFlatten:
          break;  // inner products read 4-D sources in NHWC order themselves
      }
    }
    const dnnl::memory::desc logits_desc({batch_, model_.num_classes}, kF32, Tag::nc);
    if (model_.layers.empty() || model_.layers.back().kind != LayerKind::kDense ||
        cur.get_desc() != logits_desc) {
      return absl::InvalidArgumentError(
          absl::StrCat("model \"", model_.spec, "\": the last layer must be a Dense layer with ",
                       model_.num_classes, " units (num_classes)"));
    }
    plan_->logits = cur;
    plan_->diff_logits = dnnl::memory(logits_desc, engine_);
    Backward();
    return std::move(plan_);
  }

 private:
  static int64_t Elements(const dnnl::memory::desc& d) {
    int64_t n = 1;
    for (int64_t x : d.dims()) n *= x;
    return n;
  }

  dnnl::memory UserMemory(const Dims& dims, Tag tag) {
    return dnnl::memory(dnnl::memory::desc(dims, kF32, tag), engine_, DNNL_MEMORY_NONE);
  }

  // Binds variable `index` of the model to user memories with `dims`/`tag`,
  // checking the element count against the model's VariableSpec.
  absl::Status BindVariable(const LayerDef& layer, int index, const Dims& dims, Tag tag) {
    if (index < 0 || static_cast<size_t>(index) >= model_.variables.size()) {
      return absl::InvalidArgumentError(
          absl::StrCat("layer ", layer.name, ": variable index ", index, " is out of range"));
    }
    int64_t n = 1;
    for (int64_t d : dims) n *= d;
    const VariableSpec& spec = model_.variables[index];
    if (spec.num_elements() != n) {
      return absl::InvalidArgumentError(absl::StrCat("variable ", spec.name, " has ",
                                                     spec.num_elements(), " elements; layer ",
                                                     layer.name, " expects ", n));
    }
    plan_->params[index] = UserMemory(dims, tag);
    plan_->grads[index] = UserMemory(dims, tag);
    return absl::OkStatus();
  }

  // `have` if it already has layout `want`, else a new buffer filled from
  // `have` by a reorder appended to `list`.
  dnnl::memory Convert(const dnnl::memory& have, const dnnl::memory::desc& want,
                       std::vector<OneDnnPlan::Exec>* list) {
    if (have.get_desc() == want) return have;
    dnnl::memory out(want, engine_);
    list->push_back({dnnl::reorder(have, out), {{DNNL_ARG_FROM, have}, {DNNL_ARG_TO, out}}});
    return out;
  }

  static dnnl::primitive_attr ReluAttr(bool relu) {
    dnnl::primitive_attr attr;
    if (relu) {
      dnnl::post_ops ops;
      ops.append_eltwise(1.0f, dnnl::algorithm::eltwise_relu, 0.0f, 0.0f);
      attr.set_post_ops(ops);
    }
    return attr;
  }

  absl::StatusOr<dnnl::memory> Conv(const LayerDef& l, const dnnl::memory& cur) {
    ForwardOp op;
    op.layer = &l;
    PSFLOW_RETURN_IF_ERROR(WindowGeometry(l, &op));
    const int cin = l.input.c, cout = l.units;
    PSFLOW_RETURN_IF_ERROR(
        BindVariable(l, l.kernel_var, {cout, cin, l.kernel, l.kernel}, Tag::hwio));
    PSFLOW_RETURN_IF_ERROR(BindVariable(l, l.bias_var, {cout}, Tag::x));
    const dnnl::memory::desc src({batch_, cin, l.input.h, l.input.w}, kF32, Tag::any);
    const dnnl::memory::desc weights({cout, cin, l.kernel, l.kernel}, kF32, Tag::any);
    const dnnl::memory::desc bias({cout}, kF32, Tag::x);
    const dnnl::memory::desc dst({batch_, cout, l.output.h, l.output.w}, kF32, Tag::any);
    op.conv_pd = dnnl::convolution_forward::primitive_desc(
        dnnl::convolution_forward::desc(dnnl::prop_kind::forward_training,
                                        dnnl::algorithm::convolution_direct, src, weights, bias,
                                        dst, op.strides, op.pad_l, op.pad_r),
        ReluAttr(l.relu), engine_);
    op.src = Convert(cur, op.conv_pd.src_desc(), &plan_->forward);
    op.weights = Convert(plan_->params[l.kernel_var], op.conv_pd.weights_desc(), &plan_->forward);
    op.dst = dnnl::memory(op.conv_pd.dst_desc(), engine_);
    plan_->forward.push_back({dnnl::convolution_forward(op.conv_pd),
                              {{DNNL_ARG_SRC, op.src},
                               {DNNL_ARG_WEIGHTS, op.weights},
                               {DNNL_ARG_BIAS, plan_->params[l.bias_var]},
                               {DNNL_ARG_DST, op.dst}}});
    ops_.push_back(op);
    return op.dst;
  }

  // A Dense layer reads its input flattened in NHWC order (Keras Flatten of
  // channels_last data): a 4-D source {n, c, h, w} in nhwc with weights
  // {o, c, h, w} in hwio is exactly the Keras [h*w*c, units] product.
  // Unlike convolutions, dense layers use these plain layouts, the caller's
  // own: with format_tag::any oneDNN picks blocked weights, and reordering
  // the 11 MB seed-model kernel three times a step cost more than the
  // blocked kernels gained (measured 11.3 ms vs 9.3 ms a step, batch 64).
  absl::StatusOr<dnnl::memory> Dense(const LayerDef& l, const dnnl::memory& cur) {
    ForwardOp op;
    op.layer = &l;
    const Dims in_dims = cur.get_desc().dims();
    Dims w_dims = in_dims;
    w_dims[0] = l.units;
    const Tag user_tag = in_dims.size() == 4 ? Tag::hwio : Tag::io;
    PSFLOW_RETURN_IF_ERROR(BindVariable(l, l.kernel_var, w_dims, user_tag));
    PSFLOW_RETURN_IF_ERROR(BindVariable(l, l.bias_var, {l.units}, Tag::x));
    const dnnl::memory::desc src(in_dims, kF32, in_dims.size() == 4 ? Tag::nhwc : Tag::nc);
    const dnnl::memory::desc weights(w_dims, kF32, user_tag);
    const dnnl::memory::desc bias({l.units}, kF32, Tag::x);
    const dnnl::memory::desc dst({batch_, l.units}, kF32, Tag::nc);
    op.ip_pd = dnnl::inner_product_forward::primitive_desc(
        dnnl::inner_product_forward::desc(dnnl::prop_kind::forward_training, src, weights, bias,
                                          dst),
        ReluAttr(l.relu), engine_);
    op.src = Convert(cur, op.ip_pd.src_desc(), &plan_->forward);
    op.weights = Convert(plan_->params[l.kernel_var], op.ip_pd.weights_desc(), &plan_->forward);
    op.dst = dnnl::memory(op.ip_pd.dst_desc(), engine_);
    plan_->forward.push_back({dnnl::inner_product_forward(op.ip_pd),
                              {{DNNL_ARG_SRC, op.src},
                               {DNNL_ARG_WEIGHTS, op.weights},
                               {DNNL_ARG_BIAS, plan_->params[l.bias_var]},
                               {DNNL_ARG_DST, op.dst}}});
    ops_.push_back(op);
    return op.dst;
  }

  absl::StatusOr<dnnl::memory> Pool(const LayerDef& l, const dnnl::memory& cur) {
    ForwardOp op;
    op.layer = &l;
    PSFLOW_RETURN_IF_ERROR(WindowGeometry(l, &op));
    if (cur.get_desc().dims().size() != 4) {
      return absl::InvalidArgumentError(
          absl::StrCat("layer ", l.name, ": MaxPool2D needs an image input, not a flat one"));
    }
    const dnnl::memory::desc dst({batch_, l.input.c, l.output.h, l.output.w}, kF32, Tag::any);
    op.pool_pd = dnnl::pooling_forward::primitive_desc(
        dnnl::pooling_forward::desc(dnnl::prop_kind::forward_training, dnnl::algorithm::pooling_max,
                                    cur.get_desc(), dst, op.strides, op.kernel, op.pad_l, op.pad_r),
        engine_);
    op.src = cur;
    op.dst = dnnl::memory(op.pool_pd.dst_desc(), engine_);
    op.workspace = dnnl::memory(op.pool_pd.workspace_desc(), engine_);
    plan_->forward.push_back(
        {dnnl::pooling_forward(op.pool_pd),
         {{DNNL_ARG_SRC, op.src}, {DNNL_ARG_DST, op.dst}, {DNNL_ARG_WORKSPACE, op.workspace}}});
    ops_.push_back(op);
    return op.dst;
  }

  // In-place ReLU backward on `diff` (laid out like `dst`), using the
  // forward output: the gradient passes where the output is positive.
  void ReluBackward(const dnnl::memory& dst, const dnnl::memory& diff) {
    const auto alg = dnnl::algorithm::eltwise_relu_use_dst_for_bwd;
    const dnnl::memory::desc& d = dst.get_desc();
    dnnl::eltwise_forward::primitive_desc hint(
        dnnl::eltwise_forward::desc(dnnl::prop_kind::forward_training, alg, d, 0.0f, 0.0f),
        engine_);
    dnnl::eltwise_backward::primitive_desc pd(dnnl::eltwise_backward::desc(alg, d, d, 0.0f, 0.0f),
                                              engine_, hint);
    plan_->backward.push_back(
        {dnnl::eltwise_backward(pd),
         {{DNNL_ARG_DST, dst}, {DNNL_ARG_DIFF_DST, diff}, {DNNL_ARG_DIFF_SRC, diff}}});
  }

  // Where a backward-weights primitive writes the kernel gradient: the
  // caller's buffer when the primitive wants its Keras layout, else a
  // buffer that FinishWeightGrad reorders into the caller's.
  dnnl::memory WeightGradTarget(const dnnl::memory::desc& want, int var) {
    if (plan_->grads[var].get_desc() == want) return plan_->grads[var];
    return dnnl::memory(want, engine_);
  }

  void FinishWeightGrad(const dnnl::memory& diff_weights, int var) {
    const dnnl::memory& user = plan_->grads[var];
    if (diff_weights.get() == user.get()) return;  // written in place
    plan_->backward.push_back(
        {dnnl::reorder(diff_weights, user), {{DNNL_ARG_FROM, diff_weights}, {DNNL_ARG_TO, user}}});
  }

  // Weight and bias gradients of a Dense layer by inner product (into the
  // caller's Keras-layout buffers directly) and, when wanted, its input
  // gradient diff_src = diff_dst * W^T as a matmul reading the Keras kernel
  // through a transposed view: the inner product's backward-data kernel for
  // this layout was 1.35x slower (2.9 ms vs 2.15 ms for the seed model's
  // 21632x128 kernel at batch 64).
  void DenseBackward(const ForwardOp& op, const dnnl::memory& diff_dst, bool need_diff_src,
                     dnnl::memory* diff) {
    std::vector<OneDnnPlan::Exec>* list = &plan_->backward;
    const LayerDef& l = *op.layer;
    const dnnl::memory::desc bias({l.units}, kF32, Tag::x);
    dnnl::inner_product_backward_weights::primitive_desc bw(
        dnnl::inner_product_backward_weights::desc(op.src.get_desc(), op.weights.get_desc(), bias,
                                                   op.dst.get_desc()),
        engine_, op.ip_pd);
    const dnnl::memory src = Convert(op.src, bw.src_desc(), list);
    const dnnl::memory dd = Convert(diff_dst, bw.diff_dst_desc(), list);
    const dnnl::memory dw = WeightGradTarget(bw.diff_weights_desc(), l.kernel_var);
    list->push_back({dnnl::inner_product_backward_weights(bw),
                     {{DNNL_ARG_SRC, src},
                      {DNNL_ARG_DIFF_DST, dd},
                      {DNNL_ARG_DIFF_WEIGHTS, dw},
                      {DNNL_ARG_DIFF_BIAS, plan_->grads[l.bias_var]}}});
    FinishWeightGrad(dw, l.kernel_var);
    if (!need_diff_src) return;
    const int64_t in = Elements(op.src.get_desc()) / batch_;
    const dnnl::memory::desc dd_desc({batch_, l.units}, kF32, Tag::nc);
    const dnnl::memory::desc wt_desc({l.units, in}, kF32, Dims{1, l.units});  // W^T view
    const dnnl::memory::desc dsrc_desc({batch_, in}, kF32, Tag::nc);
    dnnl::matmul::primitive_desc pd(dnnl::matmul::desc(dd_desc, wt_desc, dsrc_desc), engine_);
    const dnnl::memory mm_dd = Convert(dd, pd.src_desc(), list);
    dnnl::memory wt(pd.weights_desc(), engine_, DNNL_MEMORY_NONE);
    plan_->param_views.emplace_back(l.kernel_var, wt);
    // The same buffer seen as the flat matmul output and as the layer's
    // (4-D nhwc or 2-D nc) source gradient.
    dnnl::memory diff_src(op.src.get_desc(), engine_);
    dnnl::memory flat(pd.dst_desc(), engine_, diff_src.get_data_handle());
    list->push_back(
        {dnnl::matmul(pd), {{DNNL_ARG_SRC, mm_dd}, {DNNL_ARG_WEIGHTS, wt}, {DNNL_ARG_DST, flat}}});
    *diff = diff_src;
  }

  // Appends the backward primitives in reverse layer order. `diff` is the
  // gradient of the current op's output, in whatever layout it was produced.
  void Backward() {
    std::vector<OneDnnPlan::Exec>* list = &plan_->backward;
    dnnl::memory diff = plan_->diff_logits;
    for (int k = static_cast<int>(ops_.size()) - 1; k >= 0; --k) {
      const ForwardOp& op = ops_[k];
      const LayerDef& l = *op.layer;
      const bool need_diff_src = k > 0;  // nothing below the first op learns
      if (l.kind == LayerKind::kMaxPool2D) {
        if (!need_diff_src) break;
        dnnl::pooling_backward::primitive_desc pd(
            dnnl::pooling_backward::desc(dnnl::algorithm::pooling_max, op.src.get_desc(),
                                         op.dst.get_desc(), op.strides, op.kernel, op.pad_l,
                                         op.pad_r),
            engine_, op.pool_pd);
        const dnnl::memory diff_dst = Convert(diff, pd.diff_dst_desc(), list);
        dnnl::memory diff_src(pd.diff_src_desc(), engine_);
        list->push_back({dnnl::pooling_backward(pd),
                         {{DNNL_ARG_DIFF_DST, diff_dst},
                          {DNNL_ARG_DIFF_SRC, diff_src},
                          {DNNL_ARG_WORKSPACE, op.workspace}}});
        diff = diff_src;
        continue;
      }
      dnnl::memory diff_dst = Convert(diff, op.dst.get_desc(), list);
      if (l.relu) ReluBackward(op.dst, diff_dst);
      if (l.kind == LayerKind::kConv2D) {
        const dnnl::memory::desc src_any = AnyLike(op.src.get_desc());
        const dnnl::memory::desc w_any = AnyLike(op.weights.get_desc());
        const dnnl::memory::desc bias({l.units}, kF32, Tag::x);
        const dnnl::memory::desc dst_any = AnyLike(op.dst.get_desc());
        dnnl::convolution_backward_weights::primitive_desc bw(
            dnnl::convolution_backward_weights::desc(dnnl::algorithm::convolution_direct, src_any,
                                                     w_any, bias, dst_any, op.strides, op.pad_l,
                                                     op.pad_r),
            engine_, op.conv_pd);
        const dnnl::memory src = Convert(op.src, bw.src_desc(), list);
        const dnnl::memory dd = Convert(diff_dst, bw.diff_dst_desc(), list);
        const dnnl::memory dw = WeightGradTarget(bw.diff_weights_desc(), l.kernel_var);
        list->push_back({dnnl::convolution_backward_weights(bw),
                         {{DNNL_ARG_SRC, src},
                          {DNNL_ARG_DIFF_DST, dd},
                          {DNNL_ARG_DIFF_WEIGHTS, dw},
                          {DNNL_ARG_DIFF_BIAS, plan_->grads[l.bias_var]}}});
        FinishWeightGrad(dw, l.kernel_var);
        if (!need_diff_src) break;
        dnnl::convolution_backward_data::primitive_desc bd(
            dnnl::convolution_backward_data::desc(dnnl::algorithm::convolution_direct, src_any,
                                                  w_any, dst_any, op.strides, op.pad_l, op.pad_r),
            engine_, op.conv_pd);
        const dnnl::memory w = Convert(op.weights, bd.weights_desc(), list);
        const dnnl::memory dd2 = Convert(diff_dst, bd.diff_dst_desc(), list);
        dnnl::memory diff_src(bd.diff_src_desc(), engine_);
        list->push_back(
            {dnnl::convolution_backward_data(bd),
             {{DNNL_ARG_DIFF_DST, dd2}, {DNNL_ARG_WEIGHTS, w}, {DNNL_ARG_DIFF_SRC, diff_src}}});
        diff = diff_src;
      } else {
        DenseBackward(op, diff_dst, need_diff_src, &diff);
      }
    }
  }

  const ModelDef& model_;
  const int batch_;
  const dnnl::engine& engine_;
  std::unique_ptr<OneDnnPlan> plan_;
  std::vector<ForwardOp> ops_;
};

absl::StatusOr<std::unique_ptr<OneDnnPlan>> BuildOneDnnPlan(const ModelDef& model, int batch,
                                                            const dnnl::engine& engine) {
  try {
    return PlanBuilder(model, batch, engine).Build();
  } catch (const dnnl::error& e) {
    return absl::InternalError(absl::StrCat("oneDNN cannot build model \"", model.spec,
                                            "\" for batch ", batch, ": ", e.what()));
  }
}

// Adds the loss sum and correct count of a [batch, classes] block of logits;
// when `diff` is non-null writes d(mean loss)/d(logits) into it.
absl::Status SoftmaxCrossEntropy(const float* logits, const int32_t* labels, int batch, int classes,
                                 float* diff, StepResult* result) {
  const float inv_batch = 1.0f / static_cast<float>(batch);
  for (int n = 0; n < batch; ++n) {
    const float* z = logits + static_cast<int64_t>(n) * classes;
    const int32_t label = labels[n];
    if (label < 0 || label >= classes) {
      return absl::InvalidArgumentError(absl::StrCat("label of example ", n, " is ", label,
                                                     "; expected a class in [0, ", classes, ")"));
    }
    int arg_max = 0;
    for (int c = 1; c < classes; ++c) {
      if (z[c] > z[arg_max]) arg_max = c;
    }
    const double max_z = z[arg_max];
    double sum = 0;
    for (int c = 0; c < classes; ++c) sum += std::exp(static_cast<double>(z[c]) - max_z);
    const double log_sum = std::log(sum);
    result->loss_sum += log_sum - (static_cast<double>(z[label]) - max_z);
    if (arg_max == label) ++result->correct;
    if (diff != nullptr) {
      float* d = diff + static_cast<int64_t>(n) * classes;
      for (int c = 0; c < classes; ++c) {
        const double p = std::exp(static_cast<double>(z[c]) - max_z - log_sum);
        d[c] = static_cast<float>(p - (c == label ? 1.0 : 0.0)) * inv_batch;
      }
    }
  }
  return absl::OkStatus();
}

class OneDnnBackend : public ComputeBackend {
 public:
  explicit OneDnnBackend(const BackendOptions& options)
      : options_(options), engine_(dnnl::engine::kind::cpu, 0), stream_(engine_) {}

  std::string name() const override { return "cpu"; }

  absl::Status Prepare(const ModelDef& model, int max_batch) override {
    if (max_batch <= 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("Prepare: max_batch is ", max_batch, "; expected a positive batch size"));
    }
    SetOmpThreads(options_.threads);
    model_ = model;
    max_batch_ = 0;
    plans_.clear();
    PSFLOW_ASSIGN_OR_RETURN(std::unique_ptr<OneDnnPlan> plan,
                            BuildOneDnnPlan(model_, max_batch, engine_));
    plans_.emplace(max_batch, std::move(plan));
    max_batch_ = max_batch;
    return absl::OkStatus();
  }

  absl::Status TrainStep(absl::Span<const float* const> params, const float* images,
                         const int32_t* labels, int batch, absl::Span<float* const> grads,
                         StepResult* result) override {
    PSFLOW_ASSIGN_OR_RETURN(OneDnnPlan * plan,
                            Bind("TrainStep", params, images, labels, batch, result));
    if (grads.size() != model_.variables.size()) {
      return absl::InvalidArgumentError(absl::StrCat("TrainStep: got ", grads.size(),
                                                     " gradient buffers; the model has ",
                                                     model_.variables.size(), " variables"));
    }
    for (size_t i = 0; i < grads.size(); ++i) {
      if (grads[i] == nullptr) {
        return absl::InvalidArgumentError(
            absl::StrCat("TrainStep: gradient buffer of ", model_.variables[i].name, " is null"));
      }
    }
    for (size_t i = 0; i < grads.size(); ++i) plan->grads[i].set_data_handle(grads[i]);
    return Run(plan, labels, batch, /*train=*/true, result);
  }

  absl::Status Evaluate(absl::Span<const float* const> params, const float* images,
                        const int32_t* labels, int batch, StepResult* result) override {
    PSFLOW_ASSIGN_OR_RETURN(OneDnnPlan * plan,
                            Bind("Evaluate", params, images, labels, batch, result));
    return Run(plan, labels, batch, /*train=*/false, result);
  }

 private:
  // Checks the arguments shared by both steps, finds (or builds) the plan for
  // `batch` and points its user memories at params and images.
  absl::StatusOr<OneDnnPlan*> Bind(const char* what, absl::Span<const float* const> params,
                                   const float* images, const int32_t* labels, int batch,
                                   StepResult* result) {
    if (max_batch_ == 0) {
      return absl::FailedPreconditionError(absl::StrCat(what, ": Prepare was not called"));
    }
    if (batch <= 0 || batch > max_batch_) {
      return absl::InvalidArgumentError(absl::StrCat(what, ": batch is ", batch, "; expected 1..",
                                                     max_batch_, " (Prepare's max_batch)"));
    }
    if (params.size() != model_.variables.size()) {
      return absl::InvalidArgumentError(absl::StrCat(what, ": got ", params.size(),
                                                     " parameter buffers; the model has ",
                                                     model_.variables.size(), " variables"));
    }
    for (size_t i = 0; i < params.size(); ++i) {
      if (params[i] == nullptr) {
        return absl::InvalidArgumentError(
            absl::StrCat(what, ": parameter buffer of ", model_.variables[i].name, " is null"));
      }
    }
    if (images == nullptr || labels == nullptr || result == nullptr) {
      return absl::InvalidArgumentError(
          absl::StrCat(what, ": images, labels and result must not be null"));
    }
    SetOmpThreads(options_.threads);
    auto it = plans_.find(batch);
    if (it == plans_.end()) {
      PSFLOW_ASSIGN_OR_RETURN(std::unique_ptr<OneDnnPlan> plan,
                              BuildOneDnnPlan(model_, batch, engine_));
      it = plans_.emplace(batch, std::move(plan)).first;
    }
    OneDnnPlan* plan = it->second.get();
    // oneDNN never writes to a primitive's source or weights arguments.
    for (size_t i = 0; i < params.size(); ++i) {
      plan->params[i].set_data_handle(const_cast<float*>(params[i]));
    }
    for (auto& [var, view] : plan->param_views) {
      view.set_data_handle(const_cast<float*>(params[var]));
    }
    plan->images.set_data_handle(const_cast<float*>(images));
    return plan;
  }

  absl::Status Run(OneDnnPlan* plan, const int32_t* labels, int batch, bool train,
                   StepResult* result) {
    StepResult local;
    try {
      for (OneDnnPlan::Exec& e : plan->forward) e.primitive.execute(stream_, e.args);
      stream_.wait();
      const auto* logits = static_cast<const float*>(plan->logits.get_data_handle());
      float* diff = train ? static_cast<float*>(plan->diff_logits.get_data_handle()) : nullptr;
      PSFLOW_RETURN_IF_ERROR(
          SoftmaxCrossEntropy(logits, labels, batch, model_.num_classes, diff, &local));
      if (train) {
        for (OneDnnPlan::Exec& e : plan->backward) e.primitive.execute(stream_, e.args);
        stream_.wait();
      }
    } catch (const dnnl::error& e) {
      return absl::InternalError(absl::StrCat("oneDNN step failed: ", e.what()));
    }
    result->loss_sum += local.loss_sum;
    result->correct += local.correct;
    return absl::OkStatus();
  }

  BackendOptions options_;
  dnnl::engine engine_;
  dnnl::stream stream_;
  ModelDef model_;
  int max_batch_ = 0;
  std::map<int, std::unique_ptr<OneDnnPlan>> plans_;  // by batch size
};

}  // namespace

absl::StatusOr<std::unique_ptr<ComputeBackend>> CreateOneDnnBackend(const BackendOptions& options) {
  if (options.threads <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("cpu backend: threads is ", options.threads, "; expected at least 1"));
  }
  try {
    return std::make_unique<OneDnnBackend>(options);
  } catch (const dnnl::error& e) {
    return absl::InternalError(
        absl::StrCat("cpu backend: cannot create a oneDNN CPU engine: ", e.what()));
  }
}

}  // namespace psflow::worker
