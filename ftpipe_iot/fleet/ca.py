"""The fleet certificate authority: one CA, a broker (server) certificate, client certificates.

Keys are ECDSA P-256: small enough for microcontroller-class TLS stacks, fast to generate, and
supported by every OpenSSL that Mosquitto and Python link against. All X.509 extensions Python's
strict verification (``VERIFY_X509_STRICT``) expects are present (SKI/AKI, critical key usage).
"""

from __future__ import annotations

import datetime as dt
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from ftpipe_iot.fleet.errors import FleetError
from ftpipe_iot.fleet.passwd import write_private

CA_DAYS = 3650
LEAF_DAYS = 825  # the CA/Browser-forum ceiling; long enough for devices that are rarely touched
# Backdate validity a little so a device whose clock lags the CA host still accepts a fresh cert.
CLOCK_SKEW = dt.timedelta(minutes=5)


@dataclass(frozen=True)
class KeyPair:
    """A certificate and its private key."""

    cert: x509.Certificate
    key: ec.EllipticCurvePrivateKey

    def write(self, cert_path: Path, key_path: Path) -> None:
        """Write the certificate (0644) and the key (0600, unencrypted PEM for unattended use)."""
        cert_path.parent.mkdir(parents=True, exist_ok=True)
        write_private(cert_path, self.cert.public_bytes(serialization.Encoding.PEM), mode=0o644)
        write_private(key_path, self.key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption()))


def _now() -> dt.datetime:
    return dt.datetime.now(dt.timezone.utc)


def _name(common_name: str, organization: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, organization),
                      x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def create_ca(fleet_name: str, days: int = CA_DAYS) -> KeyPair:
    """A self-signed CA that only signs fleet leaf certificates (path length 0)."""
    key = ec.generate_private_key(ec.SECP256R1())
    name = _name(f"ftpipe-iot fleet CA ({fleet_name})", "ftpipe-iot")
    now = _now()
    ski = x509.SubjectKeyIdentifier.from_public_key(key.public_key())
    cert = (x509.CertificateBuilder()
            .subject_name(name).issuer_name(name)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - CLOCK_SKEW)
            .not_valid_after(now + dt.timedelta(days=days))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(
                digital_signature=False, content_commitment=False, key_encipherment=False,
                data_encipherment=False, key_agreement=False, key_cert_sign=True, crl_sign=True,
                encipher_only=False, decipher_only=False), critical=True)
            .add_extension(ski, critical=False)
            .sign(key, hashes.SHA256()))
    return KeyPair(cert, key)


def _san(names: list[str]) -> x509.SubjectAlternativeName:
    entries: list[x509.GeneralName] = []
    for name in dict.fromkeys(names):  # de-duplicate, keep order
        try:
            entries.append(x509.IPAddress(ipaddress.ip_address(name)))
        except ValueError:
            entries.append(x509.DNSName(name))
    return x509.SubjectAlternativeName(entries)


def issue_cert(ca: KeyPair, common_name: str, *, server_names: list[str] | None = None,
               days: int = LEAF_DAYS, not_before: dt.datetime | None = None,
               not_after: dt.datetime | None = None) -> KeyPair:
    """A leaf certificate signed by ``ca``.

    With ``server_names`` it is a TLS server certificate whose SAN lists those DNS names/IPs;
    otherwise it is a client certificate whose CN is the identity name. ``not_before`` and
    ``not_after`` override the validity window (tests use them to make expired certificates).
    """
    key = ec.generate_private_key(ec.SECP256R1())
    now = _now()
    start = not_before or (now - CLOCK_SKEW)
    end = not_after or (now + dt.timedelta(days=days))
    if end <= start:
        raise FleetError(f"certificate for {common_name!r} would end before it starts")
    usage = ExtendedKeyUsageOID.SERVER_AUTH if server_names else ExtendedKeyUsageOID.CLIENT_AUTH
    builder = (x509.CertificateBuilder()
               .subject_name(_name(common_name, "ftpipe-iot"))
               .issuer_name(ca.cert.subject)
               .public_key(key.public_key())
               .serial_number(x509.random_serial_number())
               .not_valid_before(start).not_valid_after(end)
               .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
               .add_extension(x509.KeyUsage(
                   digital_signature=True, content_commitment=False, key_encipherment=False,
                   data_encipherment=False, key_agreement=False, key_cert_sign=False,
                   crl_sign=False, encipher_only=False, decipher_only=False), critical=True)
               .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
               .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()),
                              critical=False)
               .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(
                   ca.key.public_key()), critical=False))
    if server_names:
        builder = builder.add_extension(_san(server_names), critical=False)
    return KeyPair(builder.sign(ca.key, hashes.SHA256()), key)


def load_cert(path: Path) -> x509.Certificate:
    """A PEM certificate from ``path`` or a FleetError naming the file."""
    try:
        return x509.load_pem_x509_certificate(Path(path).read_bytes())
    except (OSError, ValueError) as exc:
        raise FleetError(f"cannot read certificate {path}: {exc}") from exc


def load_key(path: Path) -> ec.EllipticCurvePrivateKey:
    """An unencrypted PEM private key from ``path`` or a FleetError naming the file."""
    try:
        key = serialization.load_pem_private_key(Path(path).read_bytes(), password=None)
    except (OSError, ValueError, TypeError) as exc:
        raise FleetError(f"cannot read private key {path}: {exc}") from exc
    if not isinstance(key, ec.EllipticCurvePrivateKey):
        raise FleetError(f"{path}: expected an EC private key")
    return key


def load_ca(cert_path: Path, key_path: Path) -> KeyPair:
    """The fleet CA from its two files."""
    return KeyPair(load_cert(cert_path), load_key(key_path))


def issued_by(cert: x509.Certificate, ca_cert: x509.Certificate) -> bool:
    """True when ``cert`` carries a valid signature from ``ca_cert``'s key."""
    try:
        cert.verify_directly_issued_by(ca_cert)
    except (ValueError, TypeError, InvalidSignature):
        return False
    return True


def key_matches(cert: x509.Certificate, key_pem: bytes) -> bool:
    """True when the private key in ``key_pem`` belongs to ``cert``."""
    try:
        key = serialization.load_pem_private_key(key_pem, password=None)
    except (ValueError, TypeError):
        return False
    return key.public_key().public_bytes(  # type: ignore[union-attr]
        serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    ) == cert.public_key().public_bytes(
        serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)


def validity_problem(cert: x509.Certificate, now: dt.datetime | None = None) -> str | None:
    """``None`` when ``cert`` is valid now, else a sentence saying why not."""
    now = now or _now()
    if now < cert.not_valid_before_utc:
        return f"is not valid before {cert.not_valid_before_utc:%Y-%m-%d %H:%M} UTC " \
               "(is this machine's clock right?)"
    if now > cert.not_valid_after_utc:
        return f"expired on {cert.not_valid_after_utc:%Y-%m-%d %H:%M} UTC"
    return None
