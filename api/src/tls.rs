//! The names in berth's agent certificates: agents of a region present
//! `server.<region>.berth` or `client.<region>.berth`, and the CLI's
//! `tls cert` commands make certificates with them.

use rustls_pki_types::CertificateDer;

/// The region when none is set, as Nomad's.
pub const DEFAULT_REGION: &str = "global";

/// Whether `region` can be a DNS label of the certificate names.
pub fn check_region(region: &str) -> Result<(), String> {
    let ok = !region.is_empty()
        && region.len() <= 63
        && region
            .chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-')
        && !region.starts_with('-')
        && !region.ends_with('-');
    if ok {
        Ok(())
    } else {
        Err(format!(
            "{region:?} is not a region name (lowercase letters, digits and '-', at most 63)"
        ))
    }
}

/// The DNS names of a certificate's subject alternative names (empty when
/// it does not parse or has none).
pub fn dns_names(cert: &CertificateDer<'_>) -> Vec<String> {
    use x509_parser::extensions::GeneralName;
    let Ok((_, cert)) = x509_parser::parse_x509_certificate(cert.as_ref()) else {
        return Vec::new();
    };
    match cert.subject_alternative_name() {
        Ok(Some(san)) => san
            .value
            .general_names
            .iter()
            .filter_map(|n| match n {
                GeneralName::DNSName(d) => Some(d.to_string()),
                _ => None,
            })
            .collect(),
        _ => Vec::new(),
    }
}
