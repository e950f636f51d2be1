//! The environment: the one reader of the `GPUDIRECT_*` variables gpudirect honours.
//!
//! Every variable is read by the rules here, once per process: the first setting that consults
//! the environment takes a snapshot of every `GPUDIRECT_*` variable, and every later read parses
//! that snapshot. Setting a variable after that (with `std::env::set_var`, which is unsound once
//! other threads run) has no effect. A blank value counts as unset. A value that does not parse
//! is [`Error::InvalidEnvironment`] naming the variable, the value and the accepted values;
//! nothing falls back to a default silently.
//!
//! Booleans have one spelling table, [`parse_bool`]: `1`, `true`, `yes`, `on` and `0`, `false`,
//! `no`, `off`, in any case. The table of every variable, its values and its default is the
//! README's "Environment variables" (keep it in step); the library loaders of the -sys crates
//! read their own `GPUDIRECT_*_LIB` path variables.

use std::collections::HashMap;
use std::fmt;
use std::str::FromStr;
use std::sync::OnceLock;

use crate::error::{Error, Result};

/// The accepted boolean spellings, as error messages list them.
pub(crate) const BOOL_SPELLINGS: &str = "1, true, yes, on, 0, false, no or off";

/// Parses a boolean by the one spelling table: `1`/`true`/`yes`/`on` and `0`/`false`/`no`/`off`
/// (any case, surrounding blanks ignored).
pub(crate) fn parse_bool(s: &str) -> Option<bool> {
    match s.trim().to_ascii_lowercase().as_str() {
        "1" | "true" | "yes" | "on" => Some(true),
        "0" | "false" | "no" | "off" => Some(false),
        _ => None,
    }
}

/// A value that is not one of a setting's spellings; returned by the `FromStr` impls of
/// gpudirect's settings (e.g. [`ODirect`](crate::storage::ODirect)).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ParseValueError {
    /// The text that did not parse.
    pub value: String,
    /// The accepted spellings, e.g. `"auto, on or off"`.
    pub expected: &'static str,
}

impl ParseValueError {
    pub(crate) fn new(value: &str, expected: &'static str) -> Self {
        ParseValueError {
            value: value.to_string(),
            expected,
        }
    }
}

impl fmt::Display for ParseValueError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{:?} is not valid: expected {}",
            self.value, self.expected
        )
    }
}

impl std::error::Error for ParseValueError {}

impl From<ParseValueError> for Error {
    fn from(e: ParseValueError) -> Self {
        Error::InvalidArgument(e.to_string())
    }
}

/// Where variables are looked up: the process snapshot, or (in tests) a fixed list.
#[derive(Clone, Copy)]
pub(crate) struct Env<'a> {
    vars: &'a HashMap<String, String>,
}

static SNAPSHOT: OnceLock<HashMap<String, String>> = OnceLock::new();

impl Env<'static> {
    /// This process's `GPUDIRECT_*` variables, as they were at the first call.
    pub(crate) fn process() -> Self {
        let vars = SNAPSHOT.get_or_init(|| {
            std::env::vars_os()
                .filter_map(|(k, v)| Some((k.into_string().ok()?, v.into_string().ok()?)))
                .filter(|(k, _)| k.starts_with("GPUDIRECT_"))
                .collect()
        });
        Env { vars }
    }
}

impl<'a> Env<'a> {
    /// Looks variables up in `vars` instead of the process environment.
    #[cfg(test)]
    pub(crate) fn from_map(vars: &'a HashMap<String, String>) -> Self {
        Env { vars }
    }

    /// The raw value of `name`, `None` when unset or blank.
    pub(crate) fn raw(&self, name: &str) -> Option<&'a str> {
        self.vars
            .get(name)
            .map(String::as_str)
            .filter(|v| !v.trim().is_empty())
    }

    /// `name` parsed by `parse`; a value `parse` refuses is [`Error::InvalidEnvironment`]
    /// listing `expected`.
    pub(crate) fn parse<T>(
        &self,
        name: &'static str,
        expected: &str,
        parse: impl FnOnce(&str) -> Option<T>,
    ) -> Result<Option<T>> {
        match self.raw(name) {
            None => Ok(None),
            Some(v) => parse(v).map(Some).ok_or_else(|| invalid(name, v, expected)),
        }
    }

    /// `name` parsed by `T`'s `FromStr`, whose error lists the accepted spellings.
    pub(crate) fn var<T: FromStr<Err = ParseValueError>>(
        &self,
        name: &'static str,
    ) -> Result<Option<T>> {
        match self.raw(name) {
            None => Ok(None),
            Some(v) => v
                .parse::<T>()
                .map(Some)
                .map_err(|e| invalid(name, v, e.expected)),
        }
    }

    /// `name` as a boolean ([`parse_bool`]).
    pub(crate) fn flag(&self, name: &'static str) -> Result<Option<bool>> {
        self.parse(name, BOOL_SPELLINGS, parse_bool)
    }
}

/// The error for `name=value` that is not one of `expected`.
pub(crate) fn invalid(name: &'static str, value: &str, expected: &str) -> Error {
    Error::InvalidEnvironment {
        variable: name,
        value: value.to_string(),
        expected: expected.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn map(pairs: &[(&str, &str)]) -> HashMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    #[test]
    fn booleans_have_one_spelling_table() {
        for t in ["1", "true", "TRUE", " Yes ", "on", "On"] {
            assert_eq!(parse_bool(t), Some(true), "{t}");
        }
        for f in ["0", "false", "False", "no", "OFF"] {
            assert_eq!(parse_bool(f), Some(false), "{f}");
        }
        for bad in ["", "2", "enable", "dney", "y", "t"] {
            assert_eq!(parse_bool(bad), None, "{bad}");
        }
    }

    #[test]
    fn unparsable_values_name_the_variable_value_and_spellings() {
        let m = map(&[("GPUDIRECT_X", "maybe"), ("GPUDIRECT_BLANK", "  ")]);
        let env = Env::from_map(&m);
        assert_eq!(env.flag("GPUDIRECT_UNSET").unwrap(), None);
        assert_eq!(env.flag("GPUDIRECT_BLANK").unwrap(), None, "blank is unset");
        match env.flag("GPUDIRECT_X") {
            Err(e @ Error::InvalidEnvironment { variable, .. }) => {
                assert_eq!(variable, "GPUDIRECT_X");
                let s = e.to_string();
                assert!(s.contains("GPUDIRECT_X=\"maybe\""), "{s}");
                assert!(s.contains(BOOL_SPELLINGS), "{s}");
                assert!(!s.ends_with('.'), "{s}");
            }
            other => panic!("{other:?}"),
        }
        let n = env.parse("GPUDIRECT_X", "an integer", |v| v.parse::<u32>().ok());
        assert!(
            matches!(n, Err(Error::InvalidEnvironment { expected, .. }) if expected == "an integer")
        );
    }
}
