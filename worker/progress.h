// Keras-style progress of one epoch:
//   Epoch 1/3
//   469/469 [==============================] - 12s 25ms/step - loss: 0.4521 - accuracy: 0.8412 - 2450 img/s
// On a terminal the line is rewritten in place; elsewhere (logs, pipes) a
// plain line is printed every tenth of the epoch and at its end.
#ifndef PSFLOW_WORKER_PROGRESS_H_
#define PSFLOW_WORKER_PROGRESS_H_

#include <cstdint>
#include <cstdio>
#include <string>

#include "absl/time/clock.h"
#include "absl/time/time.h"

namespace psflow::worker {

class Progress {
 public:
  // `out` may be null (prints nothing). `prefix` starts every line (e.g.
  // "[worker 1] ").
  Progress(FILE* out, bool tty, std::string prefix);

  void StartEpoch(int epoch, int epochs, int64_t steps);
  // After step `step` (1-based) of the epoch; loss and accuracy are the
  // epoch's running means, images the examples seen so far in the epoch.
  void Update(int64_t step, double loss, double accuracy, int64_t images);
  // Ends the epoch's line; `extra` (e.g. " - test_accuracy: 0.90") is appended.
  void EndEpoch(const std::string& extra);

 private:
  std::string Line(int64_t step, double loss, double accuracy, int64_t images) const;
  FILE* out_;
  bool tty_;
  std::string prefix_;
  int64_t steps_ = 0;
  int64_t last_printed_ = 0;
  absl::Time start_;
  absl::Time last_draw_;
  std::string last_line_;
};

}  // namespace psflow::worker

#endif  // PSFLOW_WORKER_PROGRESS_H_
