"""The dialling side's check of a TLS peer's challenge answer (issue 53, H3), against real certificates."""

from __future__ import annotations

import datetime

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from kvxferd.errors import PermissionDeniedError
from kvxferd.service.peers.proof import ChallengeSigner, check_signed_proof
from kvxferd.service.peers.tls import TlsFiles
from kvxferd.rig.verify.certs import DevCA
from kvxferd.wire.challenge import Nonces, new_nonce

SPIFFE = "spiffe://kvxferd.test/ns/serving/sa/kvxferd"
OTHER = "spiffe://kvxferd.test/ns/other/sa/kvxferd"


@pytest.fixture(scope="module")
def ca(tmp_path_factory) -> DevCA:
    return DevCA(tmp_path_factory.mktemp("pki"))


def _files(ca: DevCA, name: str, spiffe_id: str, allowed: str = SPIFFE) -> TlsFiles:
    issued = ca.issue(name, dns_names=("kvxferd-peer",), spiffe_id=spiffe_id)
    return TlsFiles(str(issued.cert), str(issued.key), str(ca.cert_path), server_name="kvxferd-peer",
                    allowed_ids=(allowed,))


def test_an_allowed_peer_that_signs_our_nonces_passes(ca):
    reader, holder = _files(ca, "reader", SPIFFE), _files(ca, "holder", SPIFFE)
    nonces = Nonces(new_nonce(), new_nonce())
    signature, cert = ChallengeSigner(holder).sign(nonces)
    assert check_signed_proof(reader, "h:1", nonces, signature, cert).endswith(SPIFFE)


def test_a_signature_over_other_nonces_or_by_another_key_fails(ca):
    reader, holder, foreign = _files(ca, "reader2", SPIFFE), _files(ca, "holder2", SPIFFE), _files(ca, "f", OTHER, OTHER)
    nonces = Nonces(new_nonce(), new_nonce())
    signature, cert = ChallengeSigner(holder).sign(nonces)
    with pytest.raises(PermissionDeniedError, match="not signed"):  # an old answer replayed for a new nonce
        check_signed_proof(reader, "h:1", Nonces(new_nonce(), nonces.server), signature, cert)
    foreign_signature, foreign_cert = ChallengeSigner(foreign).sign(nonces)
    with pytest.raises(PermissionDeniedError, match="not signed"):  # the release's certificate, another key
        check_signed_proof(reader, "h:1", nonces, foreign_signature, cert)
    with pytest.raises(PermissionDeniedError, match="not on peer_allowed_ids"):  # its own, another identity
        check_signed_proof(reader, "h:1", nonces, foreign_signature, foreign_cert)
    for junk in (b"", b"not pem", b"x" * (65 << 10)):
        with pytest.raises(PermissionDeniedError):
            check_signed_proof(reader, "h:1", nonces, signature, junk)


def test_a_certificate_of_another_ca_or_one_minted_by_a_leaf_fails(ca, tmp_path):
    reader = _files(ca, "reader3", SPIFFE)
    stranger = _files(DevCA(tmp_path / "other-ca"), "stranger", SPIFFE)
    nonces = Nonces(new_nonce(), new_nonce())
    signature, cert = ChallengeSigner(stranger).sign(nonces)
    with pytest.raises(PermissionDeniedError, match="does not chain"):
        check_signed_proof(reader, "h:1", nonces, signature, cert)
    # A leaf of our CA (another identity) signs a certificate with the allowed identity: not a CA, refused.
    leaf = ca.issue("minter", dns_names=("kvxferd-peer",), spiffe_id=OTHER)
    leaf_key = serialization.load_pem_private_key(leaf.key.read_bytes(), password=None)
    leaf_cert = x509.load_pem_x509_certificate(leaf.cert.read_bytes())
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.timezone.utc)
    minted = (x509.CertificateBuilder().subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "minted")]))
              .issuer_name(leaf_cert.subject).public_key(key.public_key()).serial_number(x509.random_serial_number())
              .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
              .add_extension(x509.SubjectAlternativeName([x509.DNSName("kvxferd-peer"),
                                                          x509.UniformResourceIdentifier(SPIFFE)]), critical=False)
              .sign(leaf_key, hashes.SHA256()))
    from kvxferd.wire.challenge import signed_message
    chain = minted.public_bytes(serialization.Encoding.PEM) + leaf.cert.read_bytes()
    with pytest.raises(PermissionDeniedError, match="does not chain"):
        check_signed_proof(reader, "h:1", nonces, key.sign(signed_message(nonces), ec.ECDSA(hashes.SHA256())), chain)


def _plain_ca(directory, *, key=None, critical=False):
    """A CA as `openssl req -x509` makes one: no keyUsage, basicConstraints not critical; and a leaf of it."""
    from cryptography.x509.oid import ExtendedKeyUsageOID
    directory.mkdir(parents=True, exist_ok=True)
    ca_key = key or ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.timezone.utc)
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "plain CA")])
    sign_hash = None if not isinstance(ca_key, ec.EllipticCurvePrivateKey) else hashes.SHA256()
    ca = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(ca_key.public_key())
          .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
          .not_valid_after(now + datetime.timedelta(days=1))
          .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=critical).sign(ca_key, sign_hash))
    leaf_key = ec.generate_private_key(ec.SECP256R1())
    leaf = (x509.CertificateBuilder().subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "leaf")]))
            .issuer_name(name).public_key(leaf_key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.DNSName("kvxferd-peer"),
                                                        x509.UniformResourceIdentifier(SPIFFE)]), critical=False)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
                           critical=False)
            .sign(ca_key, sign_hash))
    pem = serialization.Encoding.PEM
    (directory / "ca.pem").write_bytes(ca.public_bytes(pem))
    (directory / "leaf.pem").write_bytes(leaf.public_bytes(pem))
    (directory / "leaf.key").write_bytes(leaf_key.private_bytes(pem, serialization.PrivateFormat.PKCS8,
                                                                serialization.NoEncryption()))
    return TlsFiles(str(directory / "leaf.pem"), str(directory / "leaf.key"), str(directory / "ca.pem"),
                    server_name="kvxferd-peer", allowed_ids=(SPIFFE,))


def test_a_ca_gRPC_accepts_passes_too_and_one_it_would_not_stops_the_daemon_at_start(tmp_path):
    """Review of issue 53: the challenge's chain check asked more than gRPC's own (keyUsage, a critical
    basicConstraints), so such a CA's daemons started and every dial was refused. Now it asks what gRPC asks,
    and the daemon checks its own chain at start the same way."""
    from cryptography.hazmat.primitives.asymmetric import ed25519

    from kvxferd.errors import InvalidArgumentError
    from kvxferd.service.peers.proof import check_own_chain
    files = _plain_ca(tmp_path / "plain")
    check_own_chain(files)
    nonces = Nonces(new_nonce(), new_nonce())
    signature, cert = ChallengeSigner(files).sign(nonces)
    assert check_signed_proof(files, "h:1", nonces, signature, cert).endswith(SPIFFE)
    ed = _plain_ca(tmp_path / "ed", key=ed25519.Ed25519PrivateKey.generate(), critical=True)  # gRPC takes it
    with pytest.raises(InvalidArgumentError, match="peers would refuse it"):
        check_own_chain(ed)
