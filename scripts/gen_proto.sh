#!/usr/bin/env bash
# Regenerate brewnet/proto/caffe_pb2.py from brewnet/proto/caffe.proto.
# Needs grpcio-tools (pip install grpcio-tools); its bundled protoc fixes the minimum
# protobuf runtime the generated file accepts -- keep pyproject's "protobuf>=" in step.
set -euo pipefail
cd "$(dirname "$0")/../brewnet/proto"
python -m grpc_tools.protoc -I. --python_out=. caffe.proto
python - <<'PY'
import re
src = open("caffe_pb2.py").read()
m = re.search(r"ValidateProtobufRuntimeVersion\(\s*_runtime_version\.Domain\.PUBLIC,\s*(\d+),\s*(\d+),\s*(\d+)", src)
if m:
    print("caffe_pb2.py needs protobuf >= %s.%s.%s" % m.groups())
PY
