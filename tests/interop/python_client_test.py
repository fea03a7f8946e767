#!/usr/bin/env python3
"""A psflow client in another language, written from docs/PROTOCOL.md alone.

It talks to a real ps_server binary with Python's gRPC (Debian's
python3-grpcio) and Python classes that protoc generates from
proto/psflow.proto, and nothing of psflow's C++: it registers a model whose
kernel (4.8 MB) is larger than gRPC's default 4 MiB message limit in chunks,
and two more whose header goes on over two messages, pushes a gradient, retries it with the same request id, pulls in answers of
4 MiB with Python's default receive limit, sends bad input, reads GetStatus,
the health service and server reflection, and stops the shard with SIGTERM. Every value is
checked exactly (SGD with learning rate 1 on values that float32 holds
exactly).

usage: python_client_test.py PS_SERVER_BINARY PROTO_FILE PROTOC
Exit 0 when every check passed, 1 when one failed, 77 (skipped) when Python
lacks grpc or protobuf.
"""

import os
import random
import re
import signal
import struct
import subprocess
import sys
import tempfile
import traceback

MIB = 1 << 20
failures = []


def check(ok, what):
    if not ok:
        failures.append(what)
        print(f"FAIL: {what}", file=sys.stderr)


def floats(values):
    return struct.pack(f"<{len(values)}f", *values)  # little-endian float32


def unpack(data):
    return list(struct.unpack(f"<{len(data) // 4}f", data))


def main():
    ps_server, proto, protoc = sys.argv[1:4]
    try:
        import grpc
        import google.protobuf  # noqa: F401 (the generated classes need it)
    except ImportError as e:
        print(f"SKIP: {e} (install Debian's python3-grpcio and python3-protobuf)")
        return 77
    with tempfile.TemporaryDirectory(prefix="psflow_py_") as gen:
        subprocess.run([protoc, f"--proto_path={os.path.dirname(proto)}", f"--python_out={gen}",
                        proto], check=True)
        sys.path.insert(0, gen)
        import psflow_pb2 as pb

    server = subprocess.Popen([ps_server, "--port=0", "--optimizer=sgd", "--learning_rate=1"],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              env={k: v for k, v in os.environ.items() if k != "TF_CONFIG"})
    start = server.stdout.readline()
    try:
        m = re.search(r"listening on [^ ]*:(\d+),", start)
        check(m is not None, f"ps_server's start line names no port: {start!r}")
        if m:
            run(grpc, pb, f"127.0.0.1:{m.group(1)}")
    except Exception:  # a call that failed: reported with the server's log
        check(False, traceback.format_exc())
    server.send_signal(signal.SIGTERM)
    try:
        rest, _ = server.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        server.kill()
        rest, _ = server.communicate()
    check(server.returncode == 0, f"ps_server exited {server.returncode} after SIGTERM")
    # Push calls that ended OK (the retry too), and the three refused.
    check("stopped after 3 pushes (3 rejected" in rest, "ps_server's count of pushes")
    if failures:
        print(f"--- ps_server's output:\n{start}{rest}", file=sys.stderr)
    return 1 if failures else 0


def run(grpc, pb, address):
    channel = grpc.insecure_channel(address)  # gRPC's defaults: 4 MiB received at most
    grpc.channel_ready_future(channel).result(timeout=30)

    def method(kind, name, request, response):
        return getattr(channel, kind)(f"/psflow.ParameterServer/{name}",
                                      request_serializer=request.SerializeToString,
                                      response_deserializer=response.FromString)

    register = method("stream_unary", "RegisterVariables", pb.RegisterRequest, pb.RegisterResponse)
    push = method("stream_unary", "Push", pb.PushRequest, pb.PushResponse)
    pull = method("unary_stream", "Pull", pb.PullRequest, pb.PullResponse)
    get_status = method("unary_unary", "GetStatus", pb.StatusRequest, pb.StatusResponse)
    raw = lambda b: b
    health = channel.unary_unary("/grpc.health.v1.Health/Check", request_serializer=raw,
                                 response_deserializer=raw)

    # One shard holds every variable whole: num_shards 1, rows [0, rows).
    shapes = {"dense/kernel": [1000, 1200], "dense/bias": [1200]}
    sizes = {name: (shape[0] * shape[1] if len(shape) == 2 else shape[0])
             for name, shape in shapes.items()}
    init = {name: [(i % 1000) * 0.25 for i in range(n)] for name, n in sizes.items()}
    grad = {name: [float(i % 7 - 3) for i in range(n)] for name, n in sizes.items()}

    def segments(values, chunk_elements=MIB // 4):
        """Messages of at most 1 MiB of data: big tensors span several,
        small ones share one (PROTOCOL: "Large parts travel as several
        stream messages")."""
        messages, current, room = [], [], chunk_elements
        for name, v in values.items():
            offset = 0
            while offset < len(v):
                take = min(room, len(v) - offset)
                current.append(pb.Segment(variable=name, offset=offset,
                                          data=floats(v[offset:offset + take])))
                offset += take
                room -= take
                if room == 0:
                    messages.append(current)
                    current, room = [], chunk_elements
        if current:
            messages.append(current)
        return messages

    header = pb.RegisterHeader(plan_fingerprint=0x5eed, num_shards=1, shard_index=0, parts=[
        pb.PartDef(variable=name, variable_shape=shape, row_begin=0, row_end=shape[0])
        for name, shape in shapes.items()])

    def registration():
        for i, segs in enumerate(segments(init)):
            yield pb.RegisterRequest(header=header if i == 0 else None, segments=segs)

    response = register(registration(), timeout=60)
    check(response.parts_created == 2, f"registration created {response.parts_created} parts")
    response = register(registration(), timeout=60)  # idempotent
    check(response.parts_kept == 2 and response.parts_created == 0,
          f"a second registration: {response}")

    # A header may go on over the next messages while no values have come
    # (PROTOCOL: a client sends a header of many thousand parts so).
    def split_header():
        for name, n in (("extra/a", 3), ("extra/b", 2)):
            yield pb.RegisterRequest(header=pb.RegisterHeader(
                plan_fingerprint=0x5eed, num_shards=1, shard_index=0,
                parts=[pb.PartDef(variable=name, variable_shape=[n], row_begin=0, row_end=n)]))
        yield pb.RegisterRequest(segments=[
            pb.Segment(variable="extra/a", data=floats([1, 2, 3])),
            pb.Segment(variable="extra/b", data=floats([4, 5]))])

    response = register(split_header(), timeout=60)
    check(response.parts_created == 2, f"a header over two messages: {response}")
    extra = {"extra/a": [None] * 3, "extra/b": [None] * 2}
    for answer in pull(pb.PullRequest(variables=["extra/a", "extra/b"]), timeout=60):
        for seg in answer.segments:
            v = unpack(seg.data)
            extra[seg.variable][seg.offset:seg.offset + len(v)] = v
    check(extra == {"extra/a": [1, 2, 3], "extra/b": [4, 5]}, f"pulled {extra}")

    def pull_all(max_chunk_bytes=4 * MIB):
        got = {name: [None] * n for name, n in sizes.items()}
        versions = set()
        budget = max_chunk_bytes or MIB  # 0 asks for the default, 1 MiB
        request = pb.PullRequest(worker_id=7, variables=list(sizes),
                                 max_chunk_bytes=max_chunk_bytes)
        for answer in pull(request, timeout=60):
            check(answer.ByteSize() <= budget,
                  f"a Pull answer of {answer.ByteSize()} bytes, over the {budget} asked")
            check(len(answer.versions) == len(answer.segments), "a version per segment")
            for seg, version in zip(answer.segments, answer.versions):
                v = unpack(seg.data)
                got[seg.variable][seg.offset:seg.offset + len(v)] = v
                versions.add(version)
        return got, versions

    request_id = random.getrandbits(64) or 1

    def push_messages(values, rid):
        for i, segs in enumerate(segments(values)):
            head = pb.PushHeader(worker_id=7, step=0, read_version=0, request_id=rid)
            yield pb.PushRequest(header=head if i == 0 else None, segments=segs)

    total = sum(sizes.values())
    response = push(push_messages(grad, request_id), timeout=60)
    check(response.elements_applied == total and response.elements_skipped == 0,
          f"the push: {response}")
    # The same request id again: a retry, applied once.
    response = push(push_messages(grad, request_id), timeout=60)
    check(response.elements_applied == 0 and response.elements_skipped == total,
          f"the retried push: {response}")

    want = {name: [p - g for p, g in zip(init[name], grad[name])] for name in sizes}
    got, versions = pull_all()  # 4 MiB answers, Python's default receive limit
    check(got == want, "pulled values after one SGD step with learning rate 1")
    check(versions == {1}, f"part versions after one push: {versions}")

    # Bad input gets a precise status and changes nothing.
    def refused(values, code, text):
        try:
            push(push_messages(values, random.getrandbits(64) or 1), timeout=60)
            check(False, f"a push of {list(values)} was accepted")
        except grpc.RpcError as e:
            check(e.code() == code and text in e.details(),
                  f"a push of {list(values)}: {e.code()} {e.details()!r}; expected {code} {text!r}")

    refused({"ghost": [1.0]}, grpc.StatusCode.NOT_FOUND, "'ghost'")
    refused({"dense/bias": [1.0] * 1201}, grpc.StatusCode.INVALID_ARGUMENT, "'dense/bias'")
    refused({"dense/bias": [float("nan")] * 1200}, grpc.StatusCode.INVALID_ARGUMENT,
            "gradient for 'dense/bias' has a non-finite value")
    got, versions = pull_all(max_chunk_bytes=0)  # 0: the default 1 MiB
    check(got == want and versions == {1}, "values unchanged after the refused pushes")

    # A second push, a fresh id.
    response = push(push_messages(grad, request_id ^ 1), timeout=60)
    check(response.elements_applied == total, f"the second push: {response}")
    status = get_status(pb.StatusRequest(), timeout=60)
    # `def` is a Python keyword: the field is read with getattr.
    parts = {getattr(p, "def").variable: (p.num_elements, p.version) for p in status.parts}
    check(parts == {**{name: (n, 2) for name, n in sizes.items()},
                    "extra/a": (3, 0), "extra/b": (2, 0)}, f"GetStatus parts: {parts}")
    check(status.max_chunk_bytes == 4 * MIB, f"GetStatus max_chunk_bytes {status.max_chunk_bytes}")
    check(status.num_parts == len(parts) and not status.next_page_token,
          f"GetStatus num_parts {status.num_parts}, next_page_token {status.next_page_token!r}")
    # The same parts, two at a time.
    listed, token, pages = [], "", 0
    while pages == 0 or token:
        page = get_status(pb.StatusRequest(page_size=2, page_token=token), timeout=60)
        listed += [getattr(p, "def").variable for p in page.parts]
        token, pages = page.next_page_token, pages + 1
        check(pages <= len(parts), f"GetStatus pages go on past {len(parts)}")
    check(listed == sorted(parts) and pages == (len(parts) + 1) // 2,
          f"GetStatus by pages of 2: {listed} in {pages} pages")
    # HealthCheckRequest{service: ""} is empty; SERVING is status 1.
    check(health(b"", timeout=60) == b"\x08\x01", "the health service answers SERVING")
    # Server reflection describes both services (grpcurl needs it): the
    # health service's descriptors used to be missing ("Symbol not found").
    reflection = channel.stream_stream(
        "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo",
        request_serializer=raw, response_deserializer=raw)
    for symbol, file in (("grpc.health.v1.Health", b"grpc/health/v1/health.proto"),
                         ("psflow.ParameterServer", b"psflow.proto")):
        # ServerReflectionRequest{file_containing_symbol (4): symbol}
        request = b"\x22" + bytes([len(symbol)]) + symbol.encode()
        answers = list(reflection(iter([request]), timeout=60))
        fields = top_level_fields(answers[0]) if len(answers) == 1 else {}
        # ServerReflectionResponse: file_descriptor_response (4), not
        # error_response (7).
        check(4 in fields and 7 not in fields and file in fields.get(4, b""),
              f"reflection of {symbol}: fields {sorted(fields)} in {answers!r:.300}")
    channel.close()


def top_level_fields(message):
    """The length-delimited and varint fields of a protobuf message, by number
    (the last value of each)."""
    fields, i = {}, 0
    def varint():
        nonlocal i
        value, shift = 0, 0
        while True:
            byte = message[i]
            i += 1
            value |= (byte & 0x7F) << shift
            shift += 7
            if byte < 0x80:
                return value
    while i < len(message):
        tag = varint()
        if tag & 7 == 2:
            length = varint()
            fields[tag >> 3] = message[i:i + length]
            i += length
        elif tag & 7 == 0:
            fields[tag >> 3] = varint()
        else:
            raise ValueError(f"wire type {tag & 7} at byte {i}")
    return fields


if __name__ == "__main__":
    sys.exit(main())
