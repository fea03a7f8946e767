#!/usr/bin/env python3
"""TensorFlow counterpart of step_bench: compute-only images/s of the seed model.

Keras Conv2D(32, 3, relu) -> Flatten -> Dense(128, relu) -> Dense(10) with
SparseCategoricalCrossentropy(from_logits=True) on random 28x28x1 inputs.
"train" is a tf.function computing the loss and the gradients of every
variable (forward + backward, no optimizer apply: psflow applies the
optimizer on the parameter server, so step_bench does not time it either);
"eval" is the forward pass and loss only. Threads: intra-op and inter-op set
to --threads, as step_bench's --threads.

    pip install tensorflow-cpu
    python3 bench/tf_step_bench.py --threads=1 --batch_size=64

Prints a table and one JSON line (prefix "JSON "), like step_bench.
"""
import argparse
import json
import os
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch_size", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--warmup", type=int, default=20)
    args = parser.parse_args()

    import numpy as np
    import tensorflow as tf

    tf.config.threading.set_intra_op_parallelism_threads(args.threads)
    tf.config.threading.set_inter_op_parallelism_threads(args.threads)

    model = tf.keras.Sequential([
        tf.keras.Input(shape=(28, 28, 1)),
        tf.keras.layers.Conv2D(32, 3, activation="relu"),
        tf.keras.layers.Flatten(),
        tf.keras.layers.Dense(128, activation="relu"),
        tf.keras.layers.Dense(10),
    ])
    loss_fn = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    rng = np.random.default_rng(7)
    images = tf.constant(rng.random((args.batch_size, 28, 28, 1), dtype=np.float32))
    labels = tf.constant(rng.integers(0, 10, args.batch_size, dtype=np.int32))

    @tf.function
    def train_step(x, y):
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
        return loss, tape.gradient(loss, model.trainable_variables)

    @tf.function
    def eval_step(x, y):
        return loss_fn(y, model(x, training=False))

    def time_phase(step):
        for _ in range(args.warmup):
            out = step(images, labels)
        _ = tf.nest.map_structure(lambda t: t.numpy(), out)
        times = []
        start = time.perf_counter()
        for _ in range(args.steps):
            t0 = time.perf_counter()
            out = step(images, labels)
            # Wait for the results, as step_bench's synchronous backend does.
            _ = tf.nest.map_structure(lambda t: t.numpy(), out)
            times.append((time.perf_counter() - t0) * 1e3)
        total = time.perf_counter() - start
        times.sort()
        return {
            "images_per_s": args.batch_size * args.steps / total,
            "median_ms": times[len(times) // 2],
            "p90_ms": times[min(len(times) - 1, len(times) * 9 // 10)],
        }

    train = time_phase(train_step)
    evaluate = time_phase(eval_step)
    print(f"tf_step_bench: tensorflow {tf.__version__} batch={args.batch_size} "
          f"threads={args.threads} steps={args.steps} warmup={args.warmup} "
          f"parameters={model.count_params()}")
    print(f"{'phase':<22} {'images/s':>12} {'median ms':>12} {'p90 ms':>12}")
    for name, r in (("train (fwd+bwd)", train), ("eval (fwd)", evaluate)):
        print(f"{name:<22} {r['images_per_s']:12.0f} {r['median_ms']:12.3f} {r['p90_ms']:12.3f}")
    print("JSON " + json.dumps({
        "bench": "tf_step_bench", "tensorflow": tf.__version__, "batch": args.batch_size,
        "threads": args.threads, "steps": args.steps,
        "train_images_per_s": round(train["images_per_s"], 1),
        "train_median_ms": round(train["median_ms"], 3),
        "eval_images_per_s": round(evaluate["images_per_s"], 1),
        "eval_median_ms": round(evaluate["median_ms"], 3),
    }))


if __name__ == "__main__":
    main()
