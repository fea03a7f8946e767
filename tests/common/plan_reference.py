#!/usr/bin/env python3
"""An independent implementation of psflow's partition plan and fingerprints.

Written from docs/PROTOCOL.md ("The partition plan", and "The model
fingerprint" under RegisterVariables), not from the C++, as a client in another language would. It
prints the test vectors that PROTOCOL.md publishes and that the C++ is
checked against (partition_plan_test.cc's
SeedModelMatchesThePublishedTestVectors, model_def_test.cc's
ModelFingerprintTest), so a change to either the rules or the code that the
other does not share fails those tests.

Run (standard library only): python3 tests/common/plan_reference.py
"""
import struct

MASK = (1 << 64) - 1


def fnv1a64(data, h=0xCBF29CE484222325):
    for byte in data:
        h ^= byte
        h = (h * 0x100000001B3) & MASK
    return h


def integer(v):
    return struct.pack("<q", v)


def string(b):
    return integer(len(b)) + b


def plan(variables, num_shards, min_split_bytes=256 * 1024):
    """variables: [(name, shape)]. Returns ({name: [[row_begin, row_end, shard]]}, fingerprint)."""
    parts, size, rows_of = {}, {}, {}
    for name, shape in variables:
        elements = 1
        for d in shape:
            elements *= d
        rows = rows_of[name] = shape[0] if shape else 1
        size[name] = 4 * elements
        k = 1
        if size[name] > min_split_bytes:
            k = min(num_shards, rows, max(1, size[name] // min_split_bytes))
        base, extra = divmod(rows, k)
        parts[name], row = [], 0
        for j in range(k):
            n = base + (1 if j < extra else 0)
            parts[name].append([row, row + n, None])
            row += n
    load = [0] * num_shards
    for name in sorted(parts, key=lambda n: (-size[n], n.encode("utf-8"))):
        row_bytes = size[name] // rows_of[name]
        taken = set()
        for part in sorted(parts[name], key=lambda p: -(p[1] - p[0])):  # stable: row order
            free = [s for s in range(num_shards) if s not in taken]
            shard = min(free, key=lambda s: (load[s], s))
            part[2] = shard
            taken.add(shard)
            load[shard] += row_bytes * (part[1] - part[0])
    data = string(b"psflow.PartitionPlan.v1") + integer(num_shards) + integer(min_split_bytes)
    data += integer(len(variables))
    shapes = dict(variables)
    for name in sorted(parts, key=lambda n: n.encode("utf-8")):
        data += string(name.encode("utf-8")) + integer(len(shapes[name]))
        data += b"".join(integer(d) for d in shapes[name]) + integer(len(parts[name]))
        for row_begin, row_end, shard in parts[name]:
            data += integer(row_begin) + integer(row_end) + integer(shard)
    return parts, fnv1a64(data)


SEED_MODEL = [("conv2d/kernel", [3, 3, 1, 32]), ("conv2d/bias", [32]),
              ("dense/kernel", [21632, 128]), ("dense/bias", [128]),
              ("dense_1/kernel", [128, 10]), ("dense_1/bias", [10])]

# The rules' edge cases, on 4 shards: exactly min_split_bytes (not cut), k
# limited by the rows (b), by the bytes (c) and by the shards with uneven
# rows (g), a scalar, and equal sizes placed by name in UTF-8 byte order
# ("e" < "f" < "\u00e9"), which here sends them to different shards.
EDGE_MODEL = [("a", [256, 256]), ("b", [3, 100000]), ("c", [1000, 200]), ("g", [7, 65536]),
              ("s", []), ("f", [1000]), ("e", [1000]), ("\u00e9", [1000])]


# The model fingerprint's layer kinds, in the order of their numbers.
LAYER_KINDS = ("conv2d", "maxpool", "flatten", "dense")


def model_fingerprint(dataset, input_shape, num_classes, layers):
    """input_shape: (height, width, channels); layers: [(kind, units, kernel,
    stride, same_padding, relu)], kind one of LAYER_KINDS."""
    data = string(b"psflow model 1") + string(dataset.encode("utf-8"))
    data += b"".join(integer(v) for v in (*input_shape, num_classes)) + integer(len(layers))
    for kind, *values in layers:
        data += integer(LAYER_KINDS.index(kind)) + b"".join(integer(int(v)) for v in values)
    return fnv1a64(data)


# conv2d:32:3:relu,flatten,dense:128:relu,dense:10 on Fashion-MNIST, as the
# worker parses it (a layer without units, kernel or stride has 0, 0, 1).
SEED_MODEL_LAYERS = [("conv2d", 32, 3, 1, False, True), ("flatten", 0, 0, 1, False, False),
                     ("dense", 128, 0, 1, False, True), ("dense", 10, 0, 1, False, False)]


def show(model, shards):
    parts, fingerprint = plan(model, shards)
    print(f"{shards} shard(s): fingerprint {fingerprint:016x}")
    for name, _ in model:
        print(f"  {name}: " + ", ".join(f"rows [{b},{e}) on {s}" for b, e, s in parts[name]))


if __name__ == "__main__":
    print("seed model")
    for shards in (1, 2, 3):
        show(SEED_MODEL, shards)
    print("edge cases")
    show(EDGE_MODEL, 4)
    print("seed model's model fingerprint on fashion_mnist: "
          f"{model_fingerprint('fashion_mnist', (28, 28, 1), 10, SEED_MODEL_LAYERS):016x}")
