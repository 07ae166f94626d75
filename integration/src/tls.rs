//! Certificates made for a test (rcgen): a CA, a server certificate for 127.0.0.1 and
//! localhost, and a client certificate, as PEM files in a temporary directory; the arguments
//! that make a `redis-server` serve TLS with them, and those of `redis-cli` and
//! `floodgate-sync` to reach it. (floodgate-sync's own tests include this file too.)

use std::path::PathBuf;

use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair,
    KeyUsagePurpose,
};

/// The files of a test's PKI.
pub struct Pki {
    dir: tempfile::TempDir,
}

impl Pki {
    /// A fresh CA, and a server and a client certificate signed by it.
    #[allow(clippy::new_without_default)]
    pub fn new() -> Pki {
        let dir = tempfile::tempdir().unwrap();
        let ca_key = KeyPair::generate().unwrap();
        let mut ca = CertificateParams::new(Vec::<String>::new()).unwrap();
        ca.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        ca.distinguished_name
            .push(DnType::CommonName, "floodgate test CA");
        ca.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
        let ca_cert = ca.self_signed(&ca_key).unwrap();
        std::fs::write(dir.path().join("ca.pem"), ca_cert.pem()).unwrap();
        let issuer = Issuer::new(ca, ca_key);
        for (name, purpose) in [
            ("server", ExtendedKeyUsagePurpose::ServerAuth),
            ("client", ExtendedKeyUsagePurpose::ClientAuth),
        ] {
            let key = KeyPair::generate().unwrap();
            let mut params =
                CertificateParams::new(vec!["127.0.0.1".to_string(), "localhost".to_string()])
                    .unwrap();
            params.distinguished_name.push(DnType::CommonName, name);
            params.extended_key_usages = vec![purpose];
            let cert = params.signed_by(&key, &issuer).unwrap();
            std::fs::write(dir.path().join(format!("{name}.pem")), cert.pem()).unwrap();
            std::fs::write(dir.path().join(format!("{name}.key")), key.serialize_pem()).unwrap();
        }
        Pki { dir }
    }

    /// A file of it: `ca.pem`, `server.pem`, `server.key`, `client.pem`, `client.key`.
    pub fn path(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }

    /// A path as a string.
    pub fn file(&self, name: &str) -> String {
        self.path(name).to_str().unwrap().to_string()
    }

    /// `redis-server` arguments: TLS only, on `port` (no plain port), client certificates
    /// required (redis-server's default).
    pub fn redis_args(&self, port: u16) -> Vec<String> {
        let mut args: Vec<String> = vec![
            "--port".into(),
            "0".into(),
            "--tls-port".into(),
            port.to_string(),
        ];
        for (flag, file) in [
            ("--tls-cert-file", "server.pem"),
            ("--tls-key-file", "server.key"),
            ("--tls-ca-cert-file", "ca.pem"),
        ] {
            args.push(flag.into());
            args.push(self.file(file));
        }
        args
    }

    /// `redis-cli` arguments to reach such a server.
    pub fn cli_args(&self) -> Vec<String> {
        vec![
            "--tls".into(),
            "--cacert".into(),
            self.file("ca.pem"),
            "--cert".into(),
            self.file("client.pem"),
            "--key".into(),
            self.file("client.key"),
        ]
    }

    /// `floodgate-sync` arguments: the CA and the client certificate.
    pub fn sync_args(&self) -> Vec<String> {
        vec![
            "--redis-ca".into(),
            self.file("ca.pem"),
            "--redis-cert".into(),
            self.file("client.pem"),
            "--redis-key".into(),
            self.file("client.key"),
        ]
    }
}
