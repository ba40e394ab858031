"""Test certificates made with ``cryptography``: a CA, a server certificate for 127.0.0.1 and
localhost, a client certificate, and a second CA that signed nothing the server trusts."""

from __future__ import annotations

import datetime
import ipaddress
import os

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID


def _key():
    return ec.generate_private_key(ec.SECP256R1())


def _cert(subject: str, key, issuer_name: str, issuer_key, *, ca: bool = False, server: bool = False):
    now = datetime.datetime.now(datetime.timezone.utc)
    b = (x509.CertificateBuilder()
         .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
         .issuer_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, issuer_name)]))
         .public_key(key.public_key()).serial_number(x509.random_serial_number())
         .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
         .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
    if server:
        b = b.add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost"),
                                                         x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                            critical=False)
    return b.sign(issuer_key, hashes.SHA256())


def _write(folder: str, name: str, obj) -> None:
    os.makedirs(folder, exist_ok=True)
    if hasattr(obj, "private_bytes"):
        data = obj.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                 serialization.NoEncryption())
    else:
        data = obj.public_bytes(serialization.Encoding.PEM)
    with open(os.path.join(folder, name), "wb") as f:
        f.write(data)


def make_certs(root: str) -> dict[str, str]:
    """Folders as ``run-ut --tls-path`` and ``tls_path`` read them: ``server`` (mutual TLS: with
    ca.crt), ``client`` (ca.crt, client.crt, client.key), ``stranger`` (a client whose CA the server
    does not trust, which trusts the server)."""
    ca_key, other_key = _key(), _key()
    ca = _cert("test CA", ca_key, "test CA", ca_key, ca=True)
    s_key, c_key, x_key = _key(), _key(), _key()
    dirs = {name: os.path.join(root, name) for name in ("server", "client", "stranger")}
    _write(dirs["server"], "server.key", s_key)
    _write(dirs["server"], "server.crt", _cert("127.0.0.1", s_key, "test CA", ca_key, server=True))
    _write(dirs["server"], "ca.crt", ca)
    _write(dirs["client"], "ca.crt", ca)
    _write(dirs["client"], "client.key", c_key)
    _write(dirs["client"], "client.crt", _cert("trainer", c_key, "test CA", ca_key))
    _write(dirs["stranger"], "ca.crt", ca)
    _write(dirs["stranger"], "client.key", x_key)
    _write(dirs["stranger"], "client.crt", _cert("stranger", x_key, "other CA", other_key))
    return dirs
