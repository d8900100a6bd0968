//! `berth tls ca create` and `berth tls cert create`: a CA for the
//! agents, and the certificates signed by it, as Nomad's `nomad tls`
//! makes them. Files are written in the working directory and never
//! overwritten; key files are 0600.
//!
//! A server certificate names `server.<region>.berth`, a client's
//! `client.<region>.berth` (both also `localhost` and 127.0.0.1), the
//! CLI's `cli.<region>.berth`. Server and client certificates serve and
//! dial (server and client auth); the CLI's only dials.

use std::io::Write;
use std::net::IpAddr;
use std::path::{Path, PathBuf};

use anyhow::{anyhow, bail, Context, Result};
use clap::{Args, Subcommand};
use rcgen::{
    BasicConstraints, CertificateParams, DistinguishedName, DnType, ExtendedKeyUsagePurpose, IsCa,
    Issuer, KeyPair, KeyUsagePurpose, SanType, SerialNumber,
};

/// The CA is valid this long by default (Nomad's five years).
pub const DEFAULT_CA_DAYS: u32 = 1825;
/// A certificate is valid this long by default (Nomad's one year).
pub const DEFAULT_CERT_DAYS: u32 = 365;
/// The domain the names and files of berth's certificates end in.
pub const DEFAULT_DOMAIN: &str = "berth";

#[derive(Subcommand, Debug)]
pub enum TlsCommand {
    /// Create the agents' certificate authority
    #[command(subcommand)]
    Ca(CaCommand),
    /// Create certificates signed by the agents' CA
    #[command(subcommand)]
    Cert(CertCommand),
}

#[derive(Subcommand, Debug)]
pub enum CaCommand {
    /// Write <domain>-agent-ca.pem and <domain>-agent-ca-key.pem in the
    /// working directory
    Create(CaCreate),
}

#[derive(Args, Debug)]
pub struct CaCreate {
    /// How many days the CA is valid
    #[arg(long, default_value_t = DEFAULT_CA_DAYS, value_name = "N")]
    pub days: u32,
    /// The domain the CA's files are named after
    #[arg(long, default_value = DEFAULT_DOMAIN, value_name = "DOMAIN")]
    pub domain: String,
}

#[derive(Subcommand, Debug)]
pub enum CertCommand {
    /// Write <region>-<role>-berth.pem and <region>-<role>-berth-key.pem
    /// in the working directory
    Create(CertCreate),
}

#[derive(Args, Debug)]
#[command(group(clap::ArgGroup::new("role").required(true).args(["server", "client", "cli"])))]
pub struct CertCreate {
    /// A certificate for a server agent
    #[arg(long)]
    pub server: bool,
    /// A certificate for a client agent
    #[arg(long)]
    pub client: bool,
    /// A certificate for the CLI
    #[arg(long)]
    pub cli: bool,
    /// The region the certificate names
    #[arg(long, default_value = berth_api::tls::DEFAULT_REGION, value_name = "REGION")]
    pub region: String,
    /// Another DNS name the certificate carries (repeatable)
    #[arg(long = "additional-dnsname", value_name = "NAME")]
    pub additional_dnsname: Vec<String>,
    /// Another IP address the certificate carries (repeatable)
    #[arg(long = "additional-ipaddress", value_name = "ADDR")]
    pub additional_ipaddress: Vec<String>,
    /// The CA certificate that signs
    #[arg(long, default_value = "berth-agent-ca.pem", value_name = "FILE")]
    pub ca: PathBuf,
    /// The CA's key
    #[arg(long, default_value = "berth-agent-ca-key.pem", value_name = "FILE")]
    pub key: PathBuf,
    /// How many days the certificate is valid
    #[arg(long, default_value_t = DEFAULT_CERT_DAYS, value_name = "N")]
    pub days: u32,
}

/// Which agent (or the CLI) a certificate is for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    Server,
    Client,
    Cli,
}

impl Role {
    pub fn name(self) -> &'static str {
        match self {
            Role::Server => "server",
            Role::Client => "client",
            Role::Cli => "cli",
        }
    }
}

/// A certificate and its key, PEM.
pub struct Pems {
    pub cert: String,
    pub key: String,
}

pub fn run(cmd: TlsCommand) -> Result<i32> {
    let dir = Path::new(".");
    match cmd {
        TlsCommand::Ca(CaCommand::Create(a)) => {
            let (cert, key) = create_ca_files(dir, &a.domain, a.days)?;
            println!("==> CA certificate saved to: {}", cert.display());
            println!("==> CA certificate key saved to: {}", key.display());
        }
        TlsCommand::Cert(CertCommand::Create(a)) => {
            let role = match (a.server, a.client, a.cli) {
                (true, _, _) => Role::Server,
                (_, true, _) => Role::Client,
                _ => Role::Cli,
            };
            let ca = read_text("the CA certificate", &a.ca)?;
            let ca_key = read_text("the CA key", &a.key)?;
            let extra = Extra::parse(&a.additional_dnsname, &a.additional_ipaddress)?;
            let pems = create_cert(role, &a.region, &extra, &ca, &ca_key, a.days)?;
            let base = format!("{}-{}-{DEFAULT_DOMAIN}", a.region, role.name());
            let (cert, key) = write_pair(dir, &free_base(dir, &base), &pems)?;
            println!(
                "==> Using CA file {} and CA key {}",
                a.ca.display(),
                a.key.display()
            );
            println!(
                "==> {} certificate saved to: {}",
                role.name(),
                cert.display()
            );
            println!(
                "==> {} certificate key saved to: {}",
                role.name(),
                key.display()
            );
        }
    }
    Ok(0)
}

fn read_text(what: &str, path: &Path) -> Result<String> {
    std::fs::read_to_string(path).with_context(|| format!("reading {what} {}", path.display()))
}

/// The names a certificate carries beyond its role's.
#[derive(Debug, Default)]
pub struct Extra {
    pub dns_names: Vec<String>,
    pub ip_addrs: Vec<IpAddr>,
}

impl Extra {
    pub fn parse(dns_names: &[String], ip_addrs: &[String]) -> Result<Extra> {
        let ip_addrs = ip_addrs
            .iter()
            .map(|a| {
                a.parse::<IpAddr>()
                    .map_err(|_| anyhow!("-additional-ipaddress {a:?} is not an IP address"))
            })
            .collect::<Result<Vec<_>>>()?;
        for n in dns_names {
            if n.is_empty() || n.parse::<IpAddr>().is_ok() {
                bail!("-additional-dnsname {n:?} is not a DNS name (an IP address goes in -additional-ipaddress)");
            }
        }
        Ok(Extra {
            dns_names: dns_names.to_vec(),
            ip_addrs,
        })
    }
}

/// A serial number: 16 random bytes, positive.
fn serial() -> SerialNumber {
    let mut bytes = *uuid::Uuid::new_v4().as_bytes();
    bytes[0] &= 0x7f;
    SerialNumber::from_slice(&bytes)
}

/// Valid from a minute ago (clocks differ a little) for `days`.
fn validity(p: &mut CertificateParams, days: u32) -> Result<()> {
    if days == 0 {
        bail!("-days must be at least 1");
    }
    let now = time::OffsetDateTime::now_utc();
    p.not_before = now - time::Duration::minutes(1);
    p.not_after = now + time::Duration::days(i64::from(days));
    Ok(())
}

/// A self-signed CA for the agents.
pub fn create_ca(domain: &str, days: u32) -> Result<Pems> {
    if domain.is_empty() || domain.contains('/') {
        bail!("-domain {domain:?} is not a domain name");
    }
    let key = KeyPair::generate().context("generating the CA key")?;
    let mut p = CertificateParams::default();
    validity(&mut p, days)?;
    p.serial_number = Some(serial());
    let mut dn = DistinguishedName::new();
    dn.push(DnType::CommonName, format!("{domain} agent CA"));
    dn.push(DnType::OrganizationName, "berth");
    p.distinguished_name = dn;
    p.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    p.key_usages = vec![
        KeyUsagePurpose::KeyCertSign,
        KeyUsagePurpose::CrlSign,
        KeyUsagePurpose::DigitalSignature,
    ];
    let cert = p.self_signed(&key).context("signing the CA certificate")?;
    Ok(Pems {
        cert: cert.pem(),
        key: key.serialize_pem(),
    })
}

/// A certificate for `role` in `region`, signed by the CA `ca_pem` with
/// its key `ca_key_pem`.
pub fn create_cert(
    role: Role,
    region: &str,
    extra: &Extra,
    ca_pem: &str,
    ca_key_pem: &str,
    days: u32,
) -> Result<Pems> {
    berth_api::tls::check_region(region).map_err(|e| anyhow!("-region {e}"))?;
    let ca_key = KeyPair::from_pem(ca_key_pem).context("the CA key is not a PEM private key")?;
    let issuer = Issuer::from_ca_cert_pem(ca_pem, ca_key)
        .context("the CA certificate is not a PEM certificate")?;
    let name = format!("{}.{region}.{DEFAULT_DOMAIN}", role.name());
    let mut dns = vec![name.clone()];
    let mut ips = Vec::new();
    if role != Role::Cli {
        dns.push("localhost".to_string());
        ips.push(IpAddr::V4(std::net::Ipv4Addr::LOCALHOST));
    }
    dns.extend(extra.dns_names.iter().cloned());
    ips.extend(extra.ip_addrs.iter().copied());
    let mut p = CertificateParams::default();
    validity(&mut p, days)?;
    p.serial_number = Some(serial());
    let mut dn = DistinguishedName::new();
    dn.push(DnType::CommonName, name);
    p.distinguished_name = dn;
    p.subject_alt_names = dns
        .into_iter()
        .map(|d| {
            let s = d
                .clone()
                .try_into()
                .map_err(|_| anyhow!("{d:?} is not a DNS name"))?;
            Ok(SanType::DnsName(s))
        })
        .collect::<Result<Vec<_>>>()?;
    p.subject_alt_names
        .extend(ips.into_iter().map(SanType::IpAddress));
    p.key_usages = vec![
        KeyUsagePurpose::DigitalSignature,
        KeyUsagePurpose::KeyEncipherment,
    ];
    p.extended_key_usages = match role {
        Role::Cli => vec![ExtendedKeyUsagePurpose::ClientAuth],
        _ => vec![
            ExtendedKeyUsagePurpose::ServerAuth,
            ExtendedKeyUsagePurpose::ClientAuth,
        ],
    };
    p.use_authority_key_identifier_extension = true;
    let key = KeyPair::generate().context("generating the key")?;
    let cert = p
        .signed_by(&key, &issuer)
        .context("signing the certificate")?;
    Ok(Pems {
        cert: cert.pem(),
        key: key.serialize_pem(),
    })
}

/// Writes a new CA in `dir`; returns the paths of its certificate and key.
pub fn create_ca_files(dir: &Path, domain: &str, days: u32) -> Result<(PathBuf, PathBuf)> {
    let pems = create_ca(domain, days)?;
    write_pair(dir, &format!("{domain}-agent-ca"), &pems)
}

/// Writes `<base>.pem` (0644) and `<base>-key.pem` (0600) in `dir`,
/// neither of which may exist yet.
/// `base`, or the first of `base-1`, `base-2`, ... whose files are not in
/// `dir` yet: each machine's certificate has a file of its own (as
/// Nomad's `tls cert create` numbers them).
pub fn free_base(dir: &Path, base: &str) -> String {
    let taken = |b: &str| {
        dir.join(format!("{b}.pem")).exists() || dir.join(format!("{b}-key.pem")).exists()
    };
    if !taken(base) {
        return base.to_string();
    }
    (1u32..)
        .map(|n| format!("{base}-{n}"))
        .find(|b| !taken(b))
        .unwrap_or_else(|| base.to_string())
}

pub fn write_pair(dir: &Path, base: &str, pems: &Pems) -> Result<(PathBuf, PathBuf)> {
    let cert = dir.join(format!("{base}.pem"));
    let key = dir.join(format!("{base}-key.pem"));
    for p in [&cert, &key] {
        if p.exists() {
            bail!(
                "{} already exists; remove it or work in another directory",
                p.display()
            );
        }
    }
    write_new(&key, pems.key.as_bytes(), 0o600)?;
    write_new(&cert, pems.cert.as_bytes(), 0o644)?;
    Ok((cert, key))
}

fn write_new(path: &Path, bytes: &[u8], mode: u32) -> Result<()> {
    use std::os::unix::fs::OpenOptionsExt;
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(mode)
        .open(path)
        .with_context(|| format!("creating {}", path.display()))?;
    f.write_all(bytes)
        .and_then(|()| f.sync_all())
        .with_context(|| format!("writing {}", path.display()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    fn names(pem: &str) -> (Vec<String>, usize) {
        let der = rustls_pki_types::CertificateDer::from_pem_slice(pem.as_bytes()).unwrap();
        let (_, c) = x509_parser::parse_x509_certificate(der.as_ref()).unwrap();
        let san = c.subject_alternative_name().unwrap().unwrap();
        let ips = san
            .value
            .general_names
            .iter()
            .filter(|n| matches!(n, x509_parser::extensions::GeneralName::IPAddress(_)))
            .count();
        (berth_api::tls::dns_names(&der), ips)
    }

    use rustls_pki_types::pem::PemObject;

    #[test]
    fn certificates_name_their_role_region_and_extras() {
        let ca = create_ca("berth", 10).unwrap();
        let extra = Extra::parse(&["node1.example".into()], &["10.0.0.1".into()]).unwrap();
        let s = create_cert(Role::Server, "eu", &extra, &ca.cert, &ca.key, 5).unwrap();
        assert_eq!(
            names(&s.cert),
            (
                vec![
                    "server.eu.berth".to_string(),
                    "localhost".into(),
                    "node1.example".into()
                ],
                2
            )
        );
        let c = create_cert(
            Role::Client,
            "global",
            &Extra::default(),
            &ca.cert,
            &ca.key,
            5,
        )
        .unwrap();
        assert_eq!(
            names(&c.cert),
            (
                vec!["client.global.berth".to_string(), "localhost".into()],
                1
            )
        );
        let cli =
            create_cert(Role::Cli, "global", &Extra::default(), &ca.cert, &ca.key, 5).unwrap();
        assert_eq!(names(&cli.cert), (vec!["cli.global.berth".to_string()], 0));
    }

    #[test]
    fn bad_input_is_a_clear_error() {
        let ca = create_ca("berth", 10).unwrap();
        let e = Extra::parse(&[], &["not-an-ip".into()]).unwrap_err();
        assert!(
            e.to_string().contains("\"not-an-ip\" is not an IP address"),
            "{e}"
        );
        let e = create_cert(Role::Server, "EU", &Extra::default(), &ca.cert, &ca.key, 5)
            .err()
            .unwrap();
        assert!(e.to_string().contains("is not a region name"), "{e}");
        let e = create_cert(Role::Server, "eu", &Extra::default(), "junk", &ca.key, 5)
            .err()
            .unwrap();
        assert!(format!("{e:#}").contains("CA certificate"), "{e:#}");
        let e = create_ca("berth", 0).err().unwrap();
        assert!(e.to_string().contains("-days"), "{e}");
    }

    #[test]
    fn files_are_never_overwritten_and_keys_are_private() {
        let dir = tempfile::tempdir().unwrap();
        let (cert, key) = create_ca_files(dir.path(), "berth", 10).unwrap();
        assert_eq!(cert, dir.path().join("berth-agent-ca.pem"));
        assert_eq!(key, dir.path().join("berth-agent-ca-key.pem"));
        let mode = |p: &Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode(&key), 0o600);
        assert_eq!(mode(&cert), 0o644);
        let before = std::fs::read(&key).unwrap();
        let e = create_ca_files(dir.path(), "berth", 10).unwrap_err();
        assert!(e.to_string().contains("already exists"), "{e}");
        assert_eq!(std::fs::read(&key).unwrap(), before);
    }

    #[test]
    fn each_further_certificate_of_a_role_gets_a_file_of_its_own() {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path();
        let base = "global-client-berth";
        assert_eq!(free_base(d, base), base);
        std::fs::write(d.join("global-client-berth.pem"), "").unwrap();
        assert_eq!(free_base(d, base), "global-client-berth-1");
        std::fs::write(d.join("global-client-berth-1-key.pem"), "").unwrap();
        assert_eq!(free_base(d, base), "global-client-berth-2");
    }
}
