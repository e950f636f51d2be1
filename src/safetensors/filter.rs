//! Which tensors to load: exact names and globs (`*` any run of characters, dots included;
//! `?` one character).

/// A tensor filter: a tensor is loaded when any pattern matches its whole name. A pattern with
/// `*` or `?` is a glob, any other an exact name. Every pattern must match at least one tensor
/// of the checkpoint, and a filter must have a pattern; otherwise the load fails with
/// [`Problem::FilterMatchedNothing`](super::Problem::FilterMatchedNothing) (a typo, or a list
/// left empty, must not load a model without its weights).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Filter {
    patterns: Vec<String>,
}

impl Filter {
    /// A filter of these patterns.
    pub fn new<I, S>(patterns: I) -> Filter
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        Filter {
            patterns: patterns.into_iter().map(Into::into).collect(),
        }
    }

    /// The patterns, as given.
    pub fn patterns(&self) -> &[String] {
        &self.patterns
    }

    /// True when `name` is selected.
    pub fn matches(&self, name: &str) -> bool {
        self.patterns
            .iter()
            .any(|p| glob(p.as_bytes(), name.as_bytes()))
    }

    /// The index of the first pattern that matches none of `names`.
    pub(crate) fn unmatched<'a>(
        &self,
        names: impl Iterator<Item = &'a str> + Clone,
    ) -> Option<&str> {
        self.patterns
            .iter()
            .find(|p| !names.clone().any(|n| glob(p.as_bytes(), n.as_bytes())))
            .map(String::as_str)
    }
}

/// Matches `pat` against all of `s` (`*`, `?`), iteratively, in O(len(pat) × len(s)) at worst.
pub(crate) fn glob(pat: &[u8], s: &[u8]) -> bool {
    let (mut p, mut i) = (0, 0);
    let mut star: Option<(usize, usize)> = None;
    while i < s.len() {
        if p < pat.len() && (pat[p] == b'?' || pat[p] == s[i]) && pat[p] != b'*' {
            p += 1;
            i += 1;
        } else if p < pat.len() && pat[p] == b'*' {
            star = Some((p, i));
            p += 1;
        } else if let Some((sp, si)) = star {
            p = sp + 1;
            i = si + 1;
            star = Some((sp, si + 1));
        } else {
            return false;
        }
    }
    pat[p..].iter().all(|&c| c == b'*')
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn globs_and_names() {
        let f = Filter::new([
            "model.embed.weight",
            "model.layers.1*.mlp.*",
            "lm_head.?eight",
        ]);
        assert!(f.matches("model.embed.weight"));
        assert!(!f.matches("model.embed.weight2"));
        assert!(!f.matches("xmodel.embed.weight"));
        assert!(f.matches("model.layers.1.mlp.up.weight"));
        assert!(f.matches("model.layers.17.mlp.down.weight"));
        assert!(!f.matches("model.layers.2.mlp.up.weight"));
        assert!(!f.matches("model.layers.1.attn.q.weight"));
        assert!(f.matches("lm_head.weight"));
        assert!(!f.matches("lm_head.weights"));
        assert!(Filter::new(["*"]).matches(""));
        assert!(Filter::new(["a**b"]).matches("ab"));
        assert!(!Filter::new(Vec::<String>::new()).matches("a"));
        assert_eq!(
            f.unmatched(["model.embed.weight", "lm_head.weight"].into_iter()),
            Some("model.layers.1*.mlp.*")
        );
        assert_eq!(
            f.unmatched(
                [
                    "model.embed.weight",
                    "lm_head.weight",
                    "model.layers.10.mlp.x"
                ]
                .into_iter()
            ),
            None
        );
    }

    #[test]
    fn glob_agrees_with_a_reference_on_random_input() {
        use rand::{Rng, SeedableRng};
        // Reference: exponential recursion, fine for short strings.
        fn slow(p: &[u8], s: &[u8]) -> bool {
            match (p.first(), s.first()) {
                (None, None) => true,
                (Some(b'*'), _) => slow(&p[1..], s) || (!s.is_empty() && slow(p, &s[1..])),
                (Some(b'?'), Some(_)) => slow(&p[1..], &s[1..]),
                (Some(a), Some(b)) if a == b => slow(&p[1..], &s[1..]),
                _ => false,
            }
        }
        let mut rng = rand::rngs::StdRng::seed_from_u64(7);
        let alpha = b"ab.*?";
        for _ in 0..20000 {
            let p: Vec<u8> = (0..rng.random_range(0..7))
                .map(|_| alpha[rng.random_range(0..5)])
                .collect();
            let s: Vec<u8> = (0..rng.random_range(0..8))
                .map(|_| alpha[rng.random_range(0..3)])
                .collect();
            assert_eq!(
                glob(&p, &s),
                slow(&p, &s),
                "{:?} {:?}",
                String::from_utf8_lossy(&p),
                String::from_utf8_lossy(&s)
            );
        }
    }
}
