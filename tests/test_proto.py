"""The committed gRPC stubs are exactly what proto/ generates: editing the .proto without
regenerating them fails here (regenerate with the command in the assertion message)."""

from __future__ import annotations

from pathlib import Path

from grpc_tools import protoc

ROOT = Path(__file__).resolve().parent.parent
REGENERATE = ("python -m grpc_tools.protoc -I proto --python_out=. --pyi_out=. --grpc_python_out=. "
              "proto/skippy_stage/v1/stage.proto")


def test_committed_stubs_match_the_proto(tmp_path):
    code = protoc.main(["protoc", f"-I{ROOT / 'proto'}", f"--python_out={tmp_path}", f"--pyi_out={tmp_path}",
                        f"--grpc_python_out={tmp_path}", str(ROOT / "proto/skippy_stage/v1/stage.proto")])
    assert code == 0
    for name in ("stage_pb2.py", "stage_pb2.pyi", "stage_pb2_grpc.py"):
        fresh = (tmp_path / "skippy_stage/v1" / name).read_text()
        committed = (ROOT / "skippy_stage/v1" / name).read_text()
        assert fresh == committed, f"skippy_stage/v1/{name} is stale; regenerate with: {REGENERATE}"
