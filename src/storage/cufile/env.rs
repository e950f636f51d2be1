//! cuFile's own environment variables: each is read here, by one function with one rule.
//!
//! cuFile reads these itself, at `cuFileDriverOpen`; gpudirect reads them to know what cuFile
//! will do (which `cufile.json` it reads, whether compatibility mode is forced, where its log
//! goes). They are read when asked, not from [`crate::env`]'s snapshot: that module holds
//! gpudirect's own `GPUDIRECT_*` settings, while these must say what cuFile sees when it opens,
//! which may be after the snapshot was taken (gpudirect itself sets [`LOGFILE`] right before a
//! single-threaded open). Reading the environment is safe with other threads running; only
//! changing it is not.

use std::ffi::OsString;
use std::path::PathBuf;

/// The variable that names the `cufile.json` cuFile reads (else `/etc/cufile.json`).
pub(in crate::storage) const CONFIG_JSON: &str = "CUFILE_ENV_PATH_JSON";
/// The variable that forces cuFile's compatibility mode (`true` or `1`).
pub(in crate::storage) const FORCE_COMPAT: &str = "CUFILE_FORCE_COMPAT_MODE";
/// The variable cuFile takes its log file from (read at `cuFileDriverOpen`; verified on
/// 1.15.1.6).
pub(in crate::storage) const LOGFILE: &str = "CUFILE_LOGFILE_PATH";

/// `CUFILE_ENV_PATH_JSON`: the file it names whenever it is set, even to an empty or relative
/// value (a relative path is the working directory's; an empty one names no file).
pub(in crate::storage) fn config_json() -> Option<PathBuf> {
    config_json_rule(std::env::var_os(CONFIG_JSON))
}

fn config_json_rule(v: Option<OsString>) -> Option<PathBuf> {
    v.map(PathBuf::from)
}

/// `CUFILE_FORCE_COMPAT_MODE`: true for `true` (any case) or `1`; anything else, unset or not
/// UTF-8, is false.
pub(in crate::storage) fn force_compat() -> bool {
    force_compat_rule(std::env::var_os(FORCE_COMPAT))
}

fn force_compat_rule(v: Option<OsString>) -> bool {
    v.and_then(|v| v.into_string().ok())
        .is_some_and(|v| v.eq_ignore_ascii_case("true") || v == "1")
}

/// `CUFILE_LOGFILE_PATH`, the user's log file: when set and not empty.
pub(in crate::storage) fn logfile() -> Option<PathBuf> {
    logfile_rule(std::env::var_os(LOGFILE))
}

fn logfile_rule(v: Option<OsString>) -> Option<PathBuf> {
    v.filter(|v| !v.is_empty()).map(PathBuf::from)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::ffi::OsStringExt;

    fn os(s: &str) -> Option<OsString> {
        Some(OsString::from(s))
    }

    #[test]
    fn config_json_names_the_file_whenever_set() {
        assert_eq!(config_json_rule(None), None);
        assert_eq!(
            config_json_rule(os("/x/cufile.json")),
            Some("/x/cufile.json".into())
        );
        assert_eq!(
            config_json_rule(os("rel/cufile.json")),
            Some("rel/cufile.json".into())
        );
        assert_eq!(config_json_rule(os("")), Some(PathBuf::new()));
    }

    #[test]
    fn force_compat_takes_true_or_1_only() {
        for v in ["true", "TRUE", "True", "1"] {
            assert!(force_compat_rule(os(v)), "{v:?}");
        }
        for v in ["", "0", "false", "yes", "on", " true", "2"] {
            assert!(!force_compat_rule(os(v)), "{v:?}");
        }
        assert!(!force_compat_rule(None));
        assert!(!force_compat_rule(Some(OsString::from_vec(vec![
            0xff, b'1'
        ]))));
    }

    #[test]
    fn logfile_ignores_an_empty_value() {
        assert_eq!(logfile_rule(None), None);
        assert_eq!(logfile_rule(os("")), None);
        assert_eq!(logfile_rule(os("/tmp/c.log")), Some("/tmp/c.log".into()));
    }
}
