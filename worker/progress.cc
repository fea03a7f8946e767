#include "worker/progress.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace psflow::worker {

Progress::Progress(FILE* out, bool tty, std::string prefix)
    : out_(out), tty_(tty), prefix_(std::move(prefix)) {}

void Progress::StartEpoch(int epoch, int epochs, int64_t steps) {
  steps_ = steps;
  last_printed_ = 0;
  start_ = last_draw_ = absl::Now();
  last_line_.clear();
  if (out_ == nullptr) return;
  std::fprintf(out_, "%sEpoch %d/%d\n", prefix_.c_str(), epoch, epochs);
  std::fflush(out_);
}

std::string Progress::Line(int64_t step, double loss, double accuracy, int64_t images) const {
  constexpr int kWidth = 30;
  const double elapsed = absl::ToDoubleSeconds(absl::Now() - start_);
  const int filled = steps_ > 0 ? static_cast<int>(kWidth * std::min<int64_t>(step, steps_) / steps_) : 0;
  std::string bar(kWidth, '.');
  for (int i = 0; i < filled; ++i) bar[i] = '=';
  if (filled < kWidth && filled > 0) bar[filled] = '>';
  const double per_step = step > 0 ? elapsed / step : 0;
  std::string time_part;
  if (step < steps_) {
    time_part = absl::StrFormat("ETA: %.0fs", per_step * (steps_ - step));
  } else {
    time_part = absl::StrFormat("%.0fs %.0fms/step", elapsed, per_step * 1e3);
  }
  return absl::StrFormat("%s%d/%d [%s] - %s - loss: %.4f - accuracy: %.4f - %.0f img/s", prefix_,
                         step, steps_, bar, time_part, loss, accuracy,
                         elapsed > 0 ? images / elapsed : 0.0);
}

void Progress::Update(int64_t step, double loss, double accuracy, int64_t images) {
  if (out_ == nullptr) return;
  const absl::Time now = absl::Now();
  if (tty_) {
    // The line of every step, drawn at most every 100 ms: EndEpoch ends the
    // epoch with its last step's, also when --train_steps stops it early (it
    // used to print what was drawn last, or nothing).
    last_line_ = Line(step, loss, accuracy, images);
    if (now - last_draw_ < absl::Milliseconds(100) && step < steps_) return;
    last_draw_ = now;
    std::fprintf(out_, "\r%s\033[K", last_line_.c_str());
    std::fflush(out_);
    return;
  }
  const int64_t every = std::max<int64_t>(1, steps_ / 10);
  last_line_ = Line(step, loss, accuracy, images);
  if (step - last_printed_ >= every && step < steps_) {
    last_printed_ = step;
    std::fprintf(out_, "%s\n", last_line_.c_str());
    std::fflush(out_);
  }
}

void Progress::EndEpoch(const std::string& extra) {
  if (out_ == nullptr) return;
  // On a terminal the line drawn last may be longer: clear its rest.
  std::fprintf(out_, "%s%s%s%s\n", tty_ ? "\r" : "", last_line_.c_str(), extra.c_str(),
               tty_ ? "\033[K" : "");
  std::fflush(out_);
}

}  // namespace psflow::worker
