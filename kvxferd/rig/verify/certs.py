"""A throw-away certificate authority for trying mutual TLS locally (tests, benchmarks, ``kvxferd dev-certs``).

Production certificates come from your PKI (cert-manager in the Helm
chart); these exist so that the secure configuration is as easy to run on
a laptop as the insecure one. Every certificate carries the identities the
daemon's allow-list matches: DNS names and, optionally, a SPIFFE URI::

    ca.pem ──signs──► <name>.pem + <name>.key   (SAN: DNS:<dns...>, URI:<spiffe>, IP:127.0.0.1)
"""

from __future__ import annotations

import dataclasses
import datetime
import ipaddress
import pathlib

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID


@dataclasses.dataclass(frozen=True)
class Issued:
    """Paths of one issued certificate and its key (PEM)."""

    cert: pathlib.Path
    key: pathlib.Path


def _key_pem(key) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())


class DevCA:
    """A self-signed CA in ``directory`` (``ca.pem``, ``ca.key``) that issues leaf certificates."""

    def __init__(self, directory: str | pathlib.Path, *, name: str = "kvxferd dev CA") -> None:
        self.directory = pathlib.Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self._key = ec.generate_private_key(ec.SECP256R1())
        now = datetime.datetime.now(datetime.timezone.utc)
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
        self._cert = (x509.CertificateBuilder().subject_name(subject).issuer_name(subject)
                      .public_key(self._key.public_key()).serial_number(x509.random_serial_number())
                      .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=30))
                      .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
                      .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                                   content_commitment=False, key_encipherment=False,
                                                   data_encipherment=False, key_agreement=False,
                                                   encipher_only=False, decipher_only=False), critical=True)
                      .sign(self._key, hashes.SHA256()))
        self.cert_path = self.directory / "ca.pem"
        self.cert_path.write_bytes(self._cert.public_bytes(serialization.Encoding.PEM))
        key_path = self.directory / "ca.key"
        key_path.write_bytes(_key_pem(self._key))
        key_path.chmod(0o600)

    def issue(self, name: str, *, dns_names: tuple[str, ...] = (), spiffe_id: str | None = None,
              valid_s: float = 30 * 86400, not_before_s: float = -300) -> Issued:
        """Write ``<name>.pem``/``<name>.key``: a client-and-server certificate signed by this CA.

        ``not_before_s``/``valid_s`` are relative to now; a negative
        ``valid_s`` issues an already expired certificate (for tests).
        """
        key = ec.generate_private_key(ec.SECP256R1())
        now = datetime.datetime.now(datetime.timezone.utc)
        start = now + datetime.timedelta(seconds=not_before_s)
        end = now + datetime.timedelta(seconds=valid_s)
        names: list[x509.GeneralName] = [x509.DNSName(d) for d in (dns_names or (name,))]
        if spiffe_id:
            names.append(x509.UniformResourceIdentifier(spiffe_id))
        names.append(x509.IPAddress(ipaddress.ip_address("127.0.0.1")))
        cert = (x509.CertificateBuilder()
                .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
                .issuer_name(self._cert.subject).public_key(key.public_key())
                .serial_number(x509.random_serial_number()).not_valid_before(min(start, end))
                .not_valid_after(end)
                .add_extension(x509.SubjectAlternativeName(names), critical=False)
                .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
                .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
                               critical=False)
                .sign(self._key, hashes.SHA256()))
        issued = Issued(self.directory / f"{name}.pem", self.directory / f"{name}.key")
        # Write the key first and replace both atomically, as a rotating secret mount does.
        _replace(issued.key, _key_pem(key), 0o600)
        _replace(issued.cert, cert.public_bytes(serialization.Encoding.PEM), 0o644)
        return issued


def _replace(path: pathlib.Path, data: bytes, mode: int) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_bytes(data)
    tmp.chmod(mode)
    tmp.replace(path)


def add_arguments(parser) -> None:
    parser.add_argument("directory", help="where to write ca.pem, <name>.pem and <name>.key")
    parser.add_argument("--name", action="append", default=[], help="a certificate to issue (repeatable; default: kvxferd)")
    parser.add_argument("--dns", default="kvxferd-peer", help="DNS name in every certificate (peer_server_name)")
    parser.add_argument("--spiffe-id", default="spiffe://kvxferd.local/kvxferd",
                        help="URI SAN in every certificate (what peer_allowed_ids matches)")


def run(args) -> int:
    """``kvxferd dev-certs DIR``: a CA and certificates for trying mutual TLS locally."""
    ca = DevCA(args.directory)
    for name in args.name or ["kvxferd"]:
        issued = ca.issue(name, dns_names=(args.dns,), spiffe_id=args.spiffe_id)
        print(f"--tls-cert {issued.cert} --tls-key {issued.key} --tls-ca {ca.cert_path} "
              f"--peer-allowed-ids {args.spiffe_id} --peer-server-name {args.dns}")
    print("development certificates only (valid 30 days); use your PKI (e.g. cert-manager) in production")
    return 0
