"""TLS, mutual TLS and a bearer token on every listener and every hop.

Certificates are made by the test itself (``support.pki``): one CA, one certificate for the
stages (server and client use), one client certificate, and an impostor from another CA.
"""

from __future__ import annotations

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from support.pipeline import reference_texts
from support.pki import write_pki

from skippy_stage.security import Credentials
from skippy_stage.v1 import stage_pb2 as pb
from skippy_stage.v1 import stage_pb2_grpc as pb_grpc

TOKEN = "s3cret-token"
PROMPT, MAX_TOKENS = "The capital of France is", 8


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    return write_pki(tmp_path_factory.mktemp("pki"), TOKEN)


@pytest.fixture(scope="module")
def secure_pipeline(smollm2, start_pipeline, pki):
    _, paths = pki
    pipeline = start_pipeline(smollm2, [(0, 15), (15, 30)], n_threads=1, tls_cert_path=paths["stage_cert"],
                              tls_key_path=paths["stage_key"], tls_ca_path=paths["ca"],
                              auth_token_path=paths["token"])
    yield pipeline
    pipeline.stop()


def generate(channel: grpc.Channel, metadata=None) -> str:
    stub = pb_grpc.StageServiceStub(channel)
    return "".join(m.text for m in stub.Generate(pb.GenerateRequest(prompt=PROMPT, max_tokens=MAX_TOKENS),
                                                 timeout=30, metadata=metadata))


def client(files, cert="client_cert", key="client_key", token: str | None = TOKEN) -> Credentials:
    return Credentials(cert=files[cert], key=files[key], ca=files["ca"], token=token)


def test_mutual_tls_with_the_token_generates_through_every_hop(secure_pipeline, pki, smollm2):
    files, _ = pki
    creds = client(files)
    with creds.channel(secure_pipeline.head_endpoint, []) as channel:
        text = generate(channel, creds.call_metadata())
    assert text == reference_texts(smollm2, [PROMPT], MAX_TOKENS)[0]  # the unsplit model's greedy answer
    status = pb_grpc.StageServiceStub(creds.channel(secure_pipeline.head_endpoint, [])).GetStatus(
        pb.GetStatusRequest(), timeout=5, metadata=creds.call_metadata())
    assert status.downstream_ok  # the head reached stage-1 over mutual TLS with the token


def test_a_client_without_a_certificate_is_refused(secure_pipeline, pki):
    files, _ = pki
    creds = Credentials(ca=files["ca"], token=TOKEN)
    with creds.channel(secure_pipeline.head_endpoint, []) as channel, pytest.raises(grpc.RpcError) as err:
        generate(channel, creds.call_metadata())
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE


def test_a_certificate_from_another_ca_is_refused(secure_pipeline, pki):
    files, _ = pki
    creds = client(files, cert="evil_cert", key="evil_key")
    with creds.channel(secure_pipeline.head_endpoint, []) as channel, pytest.raises(grpc.RpcError) as err:
        generate(channel, creds.call_metadata())
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE


def test_a_plaintext_client_is_refused(secure_pipeline):
    with grpc.insecure_channel(secure_pipeline.head_endpoint) as channel, pytest.raises(grpc.RpcError) as err:
        generate(channel, (("authorization", f"Bearer {TOKEN}"),))
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE


@pytest.mark.parametrize("token", [None, "wrong-token"], ids=["no-token", "wrong-token"])
def test_a_missing_or_wrong_token_is_unauthenticated_on_every_stage(secure_pipeline, pki, token):
    files, _ = pki
    creds = client(files, token=token)
    for cfg in secure_pipeline.configs:
        with creds.channel(str(cfg["bind_addr"]), []) as channel, pytest.raises(grpc.RpcError) as err:
            pb_grpc.StageServiceStub(channel).GetStatus(pb.GetStatusRequest(), timeout=5,
                                                        metadata=creds.call_metadata())
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    with creds.channel(secure_pipeline.head_endpoint, []) as channel, pytest.raises(grpc.RpcError) as err:
        generate(channel, creds.call_metadata())
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_health_needs_no_token_so_orchestrators_can_probe(secure_pipeline, pki):
    files, _ = pki
    creds = client(files, token=None)
    for cfg in secure_pipeline.configs:
        with creds.channel(str(cfg["bind_addr"]), []) as channel:
            resp = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
            assert resp.status == health_pb2.HealthCheckResponse.SERVING


# --------------------------------------------------------------------------- the TCP frame listener


def frame_port(pipeline, files, index: int) -> int:
    creds = client(files)
    with creds.channel(str(pipeline.configs[index]["bind_addr"]), []) as channel:
        status = pb_grpc.StageServiceStub(channel).GetStatus(pb.GetStatusRequest(), timeout=5,
                                                             metadata=creds.call_metadata())
    assert status.hop_transport == "tcp" and status.frame_port and status.tls
    return status.frame_port


def dial(port: int, creds: Credentials):
    from skippy_stage.stage import framing

    return framing.dial("127.0.0.1", port, creds=creds, purpose=pb.FrameHello.PURPOSE_HOP, stage_id="test",
                        max_message_bytes=1 << 20, timeout_s=5)


@pytest.mark.parametrize("who", ["plaintext", "no-client-certificate", "another-ca"])
def test_the_frame_listener_refuses_what_the_grpc_listener_refuses(secure_pipeline, pki, who):
    """Frames leave gRPC, not its guards: TLS, mutual TLS, and then the token."""
    from skippy_stage.stage import framing

    files, _ = pki
    creds = {"plaintext": Credentials(token=TOKEN), "no-client-certificate": Credentials(ca=files["ca"], token=TOKEN),
             "another-ca": client(files, cert="evil_cert", key="evil_key")}[who]
    port = frame_port(secure_pipeline, files, 1)
    with pytest.raises((OSError, framing.LinkClosed, framing.Refused)):
        link = dial(port, creds)
        link.send(framing.Kind.HOP_REQUEST, pb.HopRequest(hop_id=1))
        link.receive()  # TLS 1.3 tells a client its certificate was refused on the first read
    with client(files).channel(secure_pipeline.head_endpoint, []) as channel:
        assert generate(channel, client(files).call_metadata()).startswith(" Paris")


@pytest.mark.parametrize("token", [None, "wrong-token"], ids=["no-token", "wrong-token"])
def test_the_frame_listener_wants_the_token_in_the_hello(secure_pipeline, pki, token):
    from skippy_stage.stage import framing

    files, _ = pki
    port = frame_port(secure_pipeline, files, 1)
    with pytest.raises(framing.Refused) as refused:
        dial(port, client(files, token=token))
    assert refused.value.code == grpc.StatusCode.UNAUTHENTICATED.value[0]
    assert "token" in str(refused.value)
    dial(port, client(files)).close()  # the right certificate and token are welcome


def test_a_tls_mismatch_between_neighbours_is_refused_naming_both_ends(smollm2, slice_cache, pki, tmp_path):
    """stage-0 dials with TLS, stage-1 serves plaintext: the head never serves, and says why."""
    import time

    from skippy_stage.cli.local import LocalPipeline, free_ports, pipeline_configs

    files, paths = pki
    configs = pipeline_configs(str(smollm2), [(0, 15), (15, 30)], host="127.0.0.1",
                               ports=free_ports("127.0.0.1", 2),
                               extra={"cache_dir": str(slice_cache), "n_threads": 1})
    configs[0].update(tls_cert_path=paths["stage_cert"], tls_key_path=paths["stage_key"], tls_ca_path=paths["ca"])
    pipeline = LocalPipeline(configs, tmp_path)
    creds = client(files, token=None)
    try:
        error = ""
        deadline = time.monotonic() + 120
        with creds.channel(pipeline.head_endpoint, []) as channel:
            stub = pb_grpc.StageServiceStub(channel)
            while time.monotonic() < deadline and "TLS" not in error:
                try:
                    error = stub.GetStatus(pb.GetStatusRequest(), timeout=2).downstream_error
                except grpc.RpcError:
                    pass
                time.sleep(0.2)
            health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""), timeout=2)
        assert "stage-0" in error and "stage-1" in error and "TLS" in error, error
        assert health.status == health_pb2.HealthCheckResponse.NOT_SERVING
    finally:
        pipeline.stop()
