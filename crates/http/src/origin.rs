//! Base URLs as Sluice stores them: `http(s)://host:port`, nothing more. A member's URL or a
//! configured server's is used to build every later call; a path, a query or credentials in it
//! would be carried into each of them, so they are refused where the URL first arrives.

/// Checks `authority` is `host:port` (a name, an IPv4 address or a bracketed IPv6 address, and a
/// port 1–65535), with no credentials (`user:pass@`).
pub fn check_authority(authority: &str) -> Result<(), &'static str> {
    if authority.contains('@') {
        return Err("must not carry credentials (user:pass@)");
    }
    let (host, port) = authority.rsplit_once(':').ok_or("must name host:port")?;
    let host_ok = match host.strip_prefix('[') {
        Some(v6) => v6
            .strip_suffix(']')
            .is_some_and(|a| a.parse::<std::net::Ipv6Addr>().is_ok()),
        None => {
            !host.is_empty()
                && host
                    .chars()
                    .all(|c| c.is_ascii_alphanumeric() || c == '.' || c == '-' || c == '_')
        }
    };
    if !host_ok {
        return Err("must name host:port (a host name or an IP address)");
    }
    match port.parse::<u16>() {
        Ok(p) if p > 0 && port.chars().all(|c| c.is_ascii_digit()) => Ok(()),
        _ => Err("must name a port from 1 to 65535"),
    }
}

/// Checks `url` is exactly `http://host:port` or `https://host:port` (one trailing `/` is
/// tolerated): no path, query, fragment or credentials.
pub fn check_origin(url: &str) -> Result<(), &'static str> {
    let rest = url
        .strip_prefix("http://")
        .or_else(|| url.strip_prefix("https://"))
        .ok_or("must start with http:// or https://")?;
    let authority = rest.strip_suffix('/').unwrap_or(rest);
    if authority.contains(['/', '?', '#']) {
        return Err("must be exactly http(s)://host:port, without a path, query or fragment");
    }
    check_authority(authority)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn origins_are_scheme_host_and_port_only() {
        for good in [
            "http://127.0.0.1:8000",
            "http://node-1.cluster.local:8000/",
            "https://h:1",
            "http://[::1]:9401",
        ] {
            assert_eq!(check_origin(good), Ok(()), "{good}");
        }
        for (bad, why) in [
            ("http://u:p@h:1/a/../b?c", "without a path, query"),
            ("http://u:p@h:1", "must not carry credentials"),
            ("http://h:1/a", "without a path"),
            ("http://h:1?c", "without a path, query"),
            ("http://h:1#f", "fragment"),
            ("http://h", "host:port"),
            ("http://h:0", "port from 1"),
            ("http://h:99999", "port from 1"),
            ("http://:80", "host name"),
            ("http://h h:80", "host name"),
            ("ftp://h:1", "must start with"),
        ] {
            let e = check_origin(bad).unwrap_err();
            assert!(e.contains(why), "{bad}: {e}");
        }
    }
}
