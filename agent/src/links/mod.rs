//! Interface selection and live link tracking: which devices get the TC programs, why, and
//! keeping that true as interfaces come, go and get renamed.
//!
//! - [`select`]: the pure rules ([`Selector::decide`] -> [`Decision`] with a reason);
//! - [`watch`]: links from rtnetlink (dump + `RTNLGRP_LINK` notifications) as [`LinkEvent`]s;
//! - [`manager`]: [`LinkManager`] drives an [`Attacher`] from those events and reports
//!   [`LinkStatus`] for `gardenet-agent links` and metrics.
//!
//! Typical wiring:
//! ```ignore
//! let selector = args.interfaces.selector(&config.interfaces);
//! let (links, mut watcher) = links::watch(WatchOptions::default()).await?;
//! let mut mgr = LinkManager::new(selector, dataplane_attacher);
//! mgr.sync(links, Instant::now());
//! let mut tick = tokio::time::interval(Duration::from_secs(1));
//! loop {
//!     tokio::select! {
//!         ev = watcher.recv() => match ev {
//!             Some(ev) => mgr.handle(ev, Instant::now()),
//!             None => bail!("link watch stopped"),
//!         },
//!         _ = tick.tick() => mgr.tick(Instant::now()),
//!     }
//! }
//! ```

pub mod manager;
pub mod pinned;
pub mod select;
pub mod watch;

use std::fmt::Write as _;

use crate::gardener::config::{Interfaces, Pattern};

pub use manager::{Attacher, Backoff, LinkManager, LinkStatus};
pub use select::{Decision, LinkInfo, Selector};
pub use watch::{dump, watch, LinkEvent, LinkWatcher, WatchOptions};

fn parse_pattern(s: &str) -> Result<Pattern, String> {
    Pattern::new(s).map_err(|e| format!("invalid regular expression {s:?}: {e}"))
}

/// Command-line interface selection. A flag that is given replaces the corresponding list
/// of the NetworkConfig (it does not add to it), so an operator can see the whole list in
/// one place; forced names only exist on the command line.
#[derive(clap::Args, Debug, Clone, Default)]
pub struct InterfaceArgs {
    /// Attach to interfaces whose name matches REGEX (repeatable; replaces the
    /// NetworkConfig's `interfaces.include`).
    #[arg(long = "interface-include", value_name = "REGEX", value_parser = parse_pattern)]
    pub include: Vec<Pattern>,
    /// Never attach to interfaces whose name matches REGEX (repeatable; wins over include;
    /// replaces `interfaces.exclude`).
    #[arg(long = "interface-exclude", value_name = "REGEX", value_parser = parse_pattern)]
    pub exclude: Vec<Pattern>,
    /// Attach to NAME even if it is excluded, enslaved or a VF (repeat or comma-separate).
    #[arg(long = "interface-force", value_name = "NAME", value_delimiter = ',')]
    pub force: Vec<String>,
}

impl InterfaceArgs {
    /// The selector for these flags on top of the config's `interfaces` block.
    pub fn selector(&self, config: &Interfaces) -> Selector {
        let pick = |flag: &Vec<Pattern>, cfg: &Vec<Pattern>| {
            if flag.is_empty() {
                cfg.clone()
            } else {
                flag.clone()
            }
        };
        Selector::new(pick(&self.include, &config.include), pick(&self.exclude, &config.exclude), self.force.clone())
    }
}

/// Decisions for the links of the calling thread's netns, without attaching anything
/// (`gardenet-agent links` when no running agent is asked).
pub async fn explain(selector: &Selector, opts: &WatchOptions) -> anyhow::Result<Vec<LinkStatus>> {
    let links = dump(opts).await?;
    Ok(links
        .into_iter()
        .map(|l| {
            let d = selector.decide(&l);
            LinkStatus {
                index: l.index,
                name: l.name,
                kind: l.kind,
                master: l.master.map(|(_, n)| n),
                oper_up: l.oper_up,
                selected: d.attach,
                reason: d.reason,
                hooks: Vec::new(),
                error: None,
            }
        })
        .collect())
}

/// A table for humans: one line per link.
pub fn render_table(links: &[LinkStatus]) -> String {
    let mut out = String::new();
    let _ = writeln!(out, "{:<5} {:<16} {:<8} {:<5} {:<6} {:<22} REASON", "INDEX", "NAME", "KIND", "STATE", "ATTACH", "HOOKS");
    for l in links {
        let hooks = if l.hooks.is_empty() { "-".to_owned() } else { l.hooks.join(",") };
        let _ = write!(
            out,
            "{:<5} {:<16} {:<8} {:<5} {:<6} {:<22} {}",
            l.index,
            l.name,
            l.kind.as_deref().unwrap_or("-"),
            if l.oper_up { "up" } else { "down" },
            if l.selected { "yes" } else { "no" },
            hooks,
            l.reason
        );
        if let Some(e) = &l.error {
            let _ = write!(out, " [error: {e}]");
        }
        out.push('\n');
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        interfaces: InterfaceArgs,
    }

    #[test]
    fn flags_replace_config_lists_and_force_adds_names() {
        let cli = Cli::try_parse_from(["x", "--interface-include", "^wl", "--interface-include", "^eth", "--interface-force", "enP1s2,vethabc"]).unwrap();
        let sel = cli.interfaces.selector(&Interfaces::default());
        let inc: Vec<&str> = sel.include().iter().map(|p| p.as_str()).collect();
        assert_eq!(inc, ["^wl", "^eth"]);
        // Exclude not given: the config's.
        let exc: Vec<&str> = sel.exclude().iter().map(|p| p.as_str()).collect();
        assert_eq!(exc, ["^enP"]);
        assert_eq!(sel.force(), ["enP1s2", "vethabc"]);
    }

    #[test]
    fn invalid_regex_flag_is_rejected() {
        let e = Cli::try_parse_from(["x", "--interface-exclude", "(oops"]).err().unwrap();
        assert!(e.to_string().contains("invalid regular expression"), "{e}");
    }

    #[test]
    fn table_shows_reason_and_error() {
        let t = render_table(&[LinkStatus {
            index: 2,
            name: "eth0".into(),
            kind: None,
            master: None,
            oper_up: true,
            selected: true,
            reason: "included by pattern ^eth".into(),
            hooks: vec![],
            error: Some("attach failed: EBUSY".into()),
        }]);
        assert!(t.contains("eth0"), "{t}");
        assert!(t.contains("included by pattern ^eth [error: attach failed: EBUSY]"), "{t}");
    }
}
