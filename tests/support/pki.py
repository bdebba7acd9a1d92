"""Certificates for tests of TLS, mutual TLS and the bearer token, made with ``cryptography``:
one CA, a leaf (server and client use, for 127.0.0.1 and localhost) per holder, and an impostor
from another CA."""

from __future__ import annotations

import datetime
import ipaddress
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def make_ca(cn: str):
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(_name(cn)).issuer_name(_name(cn)).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(key, hashes.SHA256()))
    return key, cert


def make_leaf(ca_key, ca_cert, cn: str):
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(_name(cn)).issuer_name(ca_cert.subject).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost"),
                                                        x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
                           critical=False)
            .sign(ca_key, hashes.SHA256()))
    return key, cert


def pem_key(key) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def pem_cert(cert) -> bytes:
    return cert.public_bytes(serialization.Encoding.PEM)


def write_pki(directory: Path, token: str) -> tuple[dict[str, bytes], dict[str, str]]:
    """A CA, a stage and a client certificate from it, an impostor from another CA and the token,
    written to ``directory``: (name -> bytes, name -> path). Names: ca, stage_cert, stage_key,
    client_cert, client_key, evil_cert, evil_key, token."""
    ca_key, ca = make_ca("skippy test CA")
    stage_key, stage = make_leaf(ca_key, ca, "stage")
    client_key, client = make_leaf(ca_key, ca, "client")
    evil_ca_key, evil_ca = make_ca("impostor CA")
    evil_key, evil = make_leaf(evil_ca_key, evil_ca, "impostor")
    files = {"ca": pem_cert(ca), "stage_cert": pem_cert(stage), "stage_key": pem_key(stage_key),
             "client_cert": pem_cert(client), "client_key": pem_key(client_key),
             "evil_cert": pem_cert(evil), "evil_key": pem_key(evil_key), "token": token.encode()}
    paths = {}
    for name, data in files.items():
        (directory / name).write_bytes(data)
        paths[name] = str(directory / name)
    return files, paths
