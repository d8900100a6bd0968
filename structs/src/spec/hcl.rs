//! Reading an HCL body against a fixed schema: every attribute and block
//! must be one the caller names, values must be literals of the right type,
//! and every error carries the line it was found on.
//!
//! The job and volume specs read their files with it, and so does the
//! agent's configuration file: one reader, so that every HCL file berth
//! reads refuses the same things with the same words. [`Source`] parses a
//! text; a [`BodyReader`] checks a body (the file, or a block's body)
//! against the attributes and blocks its caller names and reads their
//! values.

use std::collections::BTreeMap;
use std::str::FromStr;
use std::time::Duration;

use hcl_edit::expr::{Expression, ObjectKey, TraversalOperator, UnaryOperator};
use hcl_edit::structure::{Attribute, Block, Body, Structure};
use hcl_edit::template::{Element, Strip, Template};
use hcl_edit::Span;

use super::{units, SpecError};
use crate::limits;

/// The text of a spec and where its lines start, to turn byte offsets into
/// line numbers.
pub struct Source<'a> {
    text: &'a str,
    line_starts: Vec<usize>,
    /// The values of the file's input variables, for `var.NAME` and
    /// `${var.NAME}`; None where the file has no variables (a reference is
    /// then an unsupported expression, or kept verbatim in a string).
    variables: Option<BTreeMap<String, Expression>>,
}

impl<'a> Source<'a> {
    pub fn new(text: &'a str) -> Self {
        let line_starts = std::iter::once(0)
            .chain(text.match_indices('\n').map(|(i, _)| i + 1))
            .collect();
        Source {
            text,
            line_starts,
            variables: None,
        }
    }

    /// Give `var.NAME` references their values (literal expressions); a
    /// reference to a name not among them is an error.
    pub(crate) fn set_variables(&mut self, variables: BTreeMap<String, Expression>) {
        self.variables = Some(variables);
    }

    /// `expr`, or the value of the variable it references (`var.NAME`).
    fn resolve<'e>(
        &'e self,
        expr: &'e Expression,
        what: &str,
    ) -> Result<&'e Expression, SpecError> {
        let (Some(vars), Some(name)) = (&self.variables, variable_reference(expr)) else {
            return Ok(expr);
        };
        vars.get(name)
            .ok_or_else(|| undeclared(self, expr, name, what))
    }

    /// The one-based line holding byte `offset`.
    pub(crate) fn line_at(&self, offset: usize) -> usize {
        self.line_starts.partition_point(|&start| start <= offset)
    }

    /// The line where `node` starts; line 1 for nodes the parser did not
    /// emit (never the case for parsed input).
    pub(crate) fn line_of<S: Span + ?Sized>(&self, node: &S) -> usize {
        node.span().map_or(1, |r| self.line_at(r.start))
    }

    /// The text `node` was parsed from, where the parser recorded it.
    pub(crate) fn text_of<S: Span + ?Sized>(&self, node: &S) -> Option<&'a str> {
        node.span().and_then(|r| self.text.get(r))
    }

    /// Parses the whole text as an HCL body.
    pub fn parse_body(&self) -> Result<Body, SpecError> {
        hcl_edit::parser::parse_body(self.text).map_err(|e| {
            let loc = e.location();
            let message = if e.message().contains("redefined attribute") {
                let key = e
                    .line()
                    .trim_start()
                    .split(|c: char| c.is_whitespace() || c == '=')
                    .next()
                    .unwrap_or_default();
                format!("attribute {key:?} is defined twice")
            } else {
                format!("syntax error at column {}: {}", loc.column(), e.message())
            };
            SpecError::at(loc.line(), message)
        })
    }
}

/// One body (the file, or a block's body) read against its schema.
pub struct BodyReader<'s, 'b> {
    src: &'s Source<'s>,
    body: &'b Body,
    /// What this body is, for messages: `task "web"`, `restart in group "g"`.
    ctx: String,
    /// The line of the block that holds the body.
    line: usize,
}

impl<'s, 'b> BodyReader<'s, 'b> {
    /// Checks that `body` holds only the attributes and blocks named.
    /// A name in both lists may be written either way (`meta = {...}` or
    /// `meta { ... }`).
    pub fn new(
        src: &'s Source<'s>,
        body: &'b Body,
        ctx: String,
        line: usize,
        attrs: &[&str],
        blocks: &[&str],
    ) -> Result<Self, SpecError> {
        for s in body.iter() {
            match s {
                Structure::Attribute(a) => {
                    let key = a.key.as_str();
                    if !attrs.contains(&key) {
                        let message = if blocks.contains(&key) {
                            format!("{key:?} in {ctx} is a block: write `{key} {{ ... }}`")
                        } else {
                            format!("unknown attribute {key:?} in {ctx}")
                        };
                        return Err(SpecError::at(src.line_of(a), message));
                    }
                }
                Structure::Block(b) => {
                    let ident = b.ident.as_str();
                    if !blocks.contains(&ident) {
                        let message = if attrs.contains(&ident) {
                            format!("{ident:?} in {ctx} is an attribute: write `{ident} = ...`")
                        } else {
                            format!("unsupported block {ident:?} in {ctx}")
                        };
                        return Err(SpecError::at(src.line_of(b), message));
                    }
                }
            }
        }
        Ok(BodyReader {
            src,
            body,
            ctx,
            line,
        })
    }

    /// A block with exactly one label (`task "web" { ... }`); returns the
    /// label and a reader whose context is `task "web"`.
    pub fn labeled(
        src: &'s Source<'s>,
        block: &'b Block,
        parent: &str,
        label_is: &str,
        attrs: &[&str],
        blocks: &[&str],
    ) -> Result<(String, Self), SpecError> {
        let ident = block.ident.as_str();
        let line = src.line_of(block);
        let label = match block.labels.as_slice() {
            [label] => label.as_str().to_string(),
            _ => {
                return Err(SpecError::at(
                    line,
                    format!(
                        "block {ident:?} in {parent} needs exactly one label, {label_is} \
                         (found {})",
                        block.labels.len()
                    ),
                ))
            }
        };
        let ctx = format!("{ident} {label:?}");
        let reader = Self::new(src, &block.body, ctx, line, attrs, blocks)?;
        Ok((label, reader))
    }

    /// A block without labels (`restart { ... }`); the reader's context is
    /// `restart in group "g"`.
    pub fn unlabeled(
        src: &'s Source<'s>,
        block: &'b Block,
        parent: &str,
        attrs: &[&str],
        blocks: &[&str],
    ) -> Result<Self, SpecError> {
        let ident = block.ident.as_str();
        let line = src.line_of(block);
        if !block.labels.is_empty() {
            return Err(SpecError::at(
                line,
                format!("block {ident:?} in {parent} takes no labels"),
            ));
        }
        Self::new(
            src,
            &block.body,
            format!("{ident} in {parent}"),
            line,
            attrs,
            blocks,
        )
    }

    pub fn ctx(&self) -> &str {
        &self.ctx
    }

    pub fn src(&self) -> &'s Source<'s> {
        self.src
    }

    fn attr(&self, name: &str) -> Option<&'b Attribute> {
        self.body.get_attribute(name)
    }

    fn what(&self, name: &str) -> String {
        format!("attribute {name:?} in {}", self.ctx)
    }

    /// The error for a required attribute that is absent.
    pub fn missing(&self, name: &str) -> SpecError {
        SpecError::at(
            self.line,
            format!("missing required attribute {name:?} in {}", self.ctx),
        )
    }

    /// An error about the value of attribute `name` (which must be set).
    pub fn invalid(&self, name: &str, problem: impl std::fmt::Display) -> SpecError {
        let line = self
            .attr(name)
            .map_or(self.line, |a| self.src.line_of(&a.value));
        SpecError::at(line, format!("{}: {problem}", self.what(name)))
    }

    pub fn string(&self, name: &str) -> Result<Option<String>, SpecError> {
        self.attr(name)
            .map(|a| to_string(self.src, &a.value, &self.what(name)))
            .transpose()
    }

    pub fn required_string(&self, name: &str) -> Result<String, SpecError> {
        self.string(name)?.ok_or_else(|| self.missing(name))
    }

    pub fn bool(&self, name: &str) -> Result<Option<bool>, SpecError> {
        let Some(a) = self.attr(name) else {
            return Ok(None);
        };
        let value = self.src.resolve(&a.value, &self.what(name))?;
        check_literal(self.src, value, &self.what(name))?;
        match value {
            Expression::Bool(b) => Ok(Some(*b.value())),
            other => Err(self.type_error(other, name, "a bool (true or false)")),
        }
    }

    /// A whole number of at most `max`. hcl-edit reads an integer beyond
    /// `u64` as a float, so an integral float is "too large", not "not a
    /// whole number"; messages show the number as it was written.
    pub fn u64(&self, name: &str, max: u64) -> Result<Option<u64>, SpecError> {
        self.number_at_most(name, max, max)
    }

    /// [`BodyReader::u64`], with `limit` saying `max` in messages.
    fn number_at_most(
        &self,
        name: &str,
        max: u64,
        limit: impl std::fmt::Display,
    ) -> Result<Option<u64>, SpecError> {
        let Some(a) = self.attr(name) else {
            return Ok(None);
        };
        let value = self.src.resolve(&a.value, &self.what(name))?;
        check_literal(self.src, value, &self.what(name))?;
        let Expression::Number(n) = value else {
            return Err(self.type_error(value, name, "a number"));
        };
        let written = self
            .src
            .text_of(value)
            .map(str::trim)
            .filter(|t| !t.is_empty())
            .map_or_else(|| n.value().to_string(), str::to_string);
        let n = n.value();
        let value = match n.as_u64() {
            Some(v) => v,
            None => {
                let f = n.as_f64().unwrap_or(f64::NAN);
                if n.as_i64().is_some() || f < 0.0 {
                    return Err(self.invalid(name, format!("{written} must not be negative")));
                }
                if !f.is_finite() || f.fract() != 0.0 {
                    return Err(
                        self.invalid(name, format!("must be a whole number, not {written}"))
                    );
                }
                // 2^64: every integral float below it converts exactly.
                if f >= 18_446_744_073_709_551_616.0 {
                    return Err(self.invalid(name, limits::too_large(&written, limit)));
                }
                f as u64
            }
        };
        if value > max {
            return Err(self.invalid(name, limits::too_large(&written, limit)));
        }
        Ok(Some(value))
    }

    /// A whole number that may be negative (`-50`), within `i64`.
    pub fn i64(&self, name: &str) -> Result<Option<i64>, SpecError> {
        let Some(a) = self.attr(name) else {
            return Ok(None);
        };
        let value = self.src.resolve(&a.value, &self.what(name))?;
        let (negative, number) = match value {
            Expression::UnaryOp(op) if *op.operator.value() == UnaryOperator::Neg => {
                (true, &op.expr)
            }
            other => (false, other),
        };
        check_literal(self.src, number, &self.what(name))?;
        let Expression::Number(n) = number else {
            return Err(self.type_error(number, name, "a whole number"));
        };
        let n = n.value();
        let whole = n
            .as_i64()
            .or_else(|| n.as_u64().and_then(|u| i64::try_from(u).ok()))
            .ok_or_else(|| self.invalid(name, format!("must be a whole number, not {n}")))?;
        Ok(Some(if negative {
            whole.saturating_neg()
        } else {
            whole
        }))
    }

    /// A whole number of at most `max`, as [`BodyReader::u64`].
    pub fn u32(&self, name: &str, max: u32) -> Result<Option<u32>, SpecError> {
        self.u64(name, u64::from(max))?
            .map(|v| u32::try_from(v).map_err(|_| self.invalid(name, limits::too_large(v, max))))
            .transpose()
    }

    /// A duration written as a string ("30s", "5m", "1h30m") of at most
    /// `max`.
    pub fn duration(&self, name: &str, max: Duration) -> Result<Option<Duration>, SpecError> {
        self.string(name)?
            .map(|s| units::parse_duration_at_most(&s, max).map_err(|e| self.invalid(name, e)))
            .transpose()
    }

    /// A size in bytes of at most `max`, written as a string with a unit
    /// ("10MiB") or as a number of bytes; `limit` says the limit in
    /// messages.
    pub fn size(&self, name: &str, max: u64, limit: &str) -> Result<Option<u64>, SpecError> {
        let value = self
            .attr(name)
            .map(|a| self.src.resolve(&a.value, &self.what(name)))
            .transpose()?;
        match value {
            None => Ok(None),
            Some(Expression::Number(_)) => self.number_at_most(name, max, limit),
            Some(_) => self
                .string(name)?
                .map(|s| {
                    units::parse_size_at_most(&s, max, limit).map_err(|e| self.invalid(name, e))
                })
                .transpose(),
        }
    }

    /// A string parsed with `T`'s `FromStr` (modes, plugin types).
    pub fn parsed<T: FromStr<Err = String>>(&self, name: &str) -> Result<Option<T>, SpecError> {
        self.string(name)?
            .map(|s| s.parse::<T>().map_err(|e| self.invalid(name, e)))
            .transpose()
    }

    /// A list of strings; numbers and bools in it are taken as their text.
    pub fn strings(&self, name: &str) -> Result<Option<Vec<String>>, SpecError> {
        let Some(a) = self.attr(name) else {
            return Ok(None);
        };
        let what = self.what(name);
        let value = self.src.resolve(&a.value, &what)?;
        check_literal(self.src, value, &what)?;
        let Expression::Array(items) = value else {
            return Err(self.type_error(value, name, "a list of strings"));
        };
        items
            .iter()
            .map(|e| to_scalar_string(self.src, e, &what))
            .collect::<Result<Vec<_>, _>>()
            .map(Some)
    }

    /// A map of strings, written as a block (`env { A = "1" }`) or as an
    /// attribute (`env = { A = "1" }`). Absent is empty.
    pub fn map(&self, name: &str) -> Result<BTreeMap<String, String>, SpecError> {
        let mut out = BTreeMap::new();
        let blocks = self.blocks(name);
        if let Some(a) = self.attr(name) {
            if let Some(b) = blocks.first() {
                return Err(SpecError::at(
                    self.src.line_of(*b),
                    format!("{name:?} is defined twice in {}", self.ctx),
                ));
            }
            let what = self.what(name);
            check_literal(self.src, &a.value, &what)?;
            let Expression::Object(obj) = &a.value else {
                return Err(self.type_error(&a.value, name, "a map"));
            };
            for (key, value) in obj.iter() {
                let key_line = self.src.line_of(key);
                let key = match key {
                    ObjectKey::Ident(i) => i.as_str().to_string(),
                    ObjectKey::Expression(e) => to_string(self.src, e, &what)?,
                };
                let value = to_scalar_string(self.src, value.expr(), &what)?;
                if out.insert(key.clone(), value).is_some() {
                    return Err(SpecError::at(
                        key_line,
                        format!("{what}: key {key:?} is defined twice"),
                    ));
                }
            }
            return Ok(out);
        }
        let Some(block) = self.optional_block(name)? else {
            return Ok(out);
        };
        let parent = self.ctx.clone();
        if !block.labels.is_empty() {
            return Err(SpecError::at(
                self.src.line_of(block),
                format!("block {name:?} in {parent} takes no labels"),
            ));
        }
        let ctx = format!("{name} in {parent}");
        for s in block.body.iter() {
            match s {
                Structure::Attribute(a) => {
                    let key = a.key.as_str();
                    let what = format!("{key:?} in {ctx}");
                    out.insert(
                        key.to_string(),
                        to_scalar_string(self.src, &a.value, &what)?,
                    );
                }
                Structure::Block(b) => {
                    return Err(SpecError::at(
                        self.src.line_of(b),
                        format!("unsupported block {:?} in {ctx}", b.ident.as_str()),
                    ))
                }
            }
        }
        Ok(out)
    }

    /// Every block named `ident`, in order.
    pub fn blocks(&self, ident: &str) -> Vec<&'b Block> {
        self.body.blocks().filter(|b| b.has_ident(ident)).collect()
    }

    /// The block named `ident`, which may appear at most once.
    pub fn optional_block(&self, ident: &str) -> Result<Option<&'b Block>, SpecError> {
        let blocks = self.blocks(ident);
        match blocks.as_slice() {
            [] => Ok(None),
            [b] => Ok(Some(b)),
            [_, second, ..] => Err(SpecError::at(
                self.src.line_of(*second),
                format!("block {ident:?} may appear only once in {}", self.ctx),
            )),
        }
    }

    fn type_error(&self, found: &Expression, name: &str, want: &str) -> SpecError {
        self.invalid(name, format!("expected {want}, found {}", kind(found)))
    }
}

/// What a literal value is, for messages.
fn kind(expr: &Expression) -> &'static str {
    match expr {
        Expression::Null(_) => "null",
        Expression::Bool(_) => "a bool",
        Expression::Number(_) => "a number",
        Expression::String(_) | Expression::StringTemplate(_) | Expression::HeredocTemplate(_) => {
            "a string"
        }
        Expression::Array(_) => "a list",
        Expression::Object(_) => "a map",
        _ => "an expression",
    }
}

/// Specs hold literal values only: berth evaluates nothing.
fn check_literal(src: &Source<'_>, expr: &Expression, what: &str) -> Result<(), SpecError> {
    let found = match expr {
        Expression::Variable(_) => "a variable reference",
        Expression::FuncCall(_) => "a function call",
        Expression::Traversal(_) => "an attribute or index access",
        Expression::UnaryOp(_) | Expression::BinaryOp(_) => "an operator",
        Expression::Conditional(_) => "a conditional",
        Expression::ForExpr(_) => "a for expression",
        Expression::Parenthesis(_) => "a parenthesized expression",
        _ => return Ok(()),
    };
    Err(SpecError::at(
        src.line_of(expr),
        format!("{what}: expressions are not supported (found {found})"),
    ))
}

/// A string value. `${NAME}` interpolations are kept verbatim: berth fills
/// them in from the task environment when the task starts; `${var.NAME}`
/// takes the input variable's value.
fn to_string(src: &Source<'_>, expr: &Expression, what: &str) -> Result<String, SpecError> {
    let expr = src.resolve(expr, what)?;
    check_literal(src, expr, what)?;
    match expr {
        Expression::String(s) => Ok(s.value().clone()),
        Expression::StringTemplate(t) => template_text(src, t, what),
        Expression::HeredocTemplate(h) => template_text(src, &h.template, what),
        other => Err(SpecError::at(
            src.line_of(other),
            format!("{what}: expected a string, found {}", kind(other)),
        )),
    }
}

/// A string, or a number or bool taken as its text (map values, args).
fn to_scalar_string(src: &Source<'_>, expr: &Expression, what: &str) -> Result<String, SpecError> {
    match src.resolve(expr, what)? {
        Expression::Number(n) => Ok(n.value().to_string()),
        Expression::Bool(b) => Ok(b.value().to_string()),
        other => to_string(src, other, what),
    }
}

fn template_text(src: &Source<'_>, template: &Template, what: &str) -> Result<String, SpecError> {
    let mut out = String::new();
    for element in template.iter() {
        match element {
            Element::Literal(lit) => out.push_str(lit.value()),
            Element::Interpolation(interp) => {
                let line = src.line_of(interp);
                if interp.strip != Strip::None {
                    return Err(SpecError::at(
                        line,
                        format!("{what}: strip markers (~) in interpolations are not supported"),
                    ));
                }
                if let (Some(vars), Some(name)) = (&src.variables, variable_reference(&interp.expr))
                {
                    let value = vars
                        .get(name)
                        .ok_or_else(|| undeclared(src, &interp.expr, name, what))?;
                    out.push_str(&to_scalar_string(src, value, what)?);
                    continue;
                }
                if !is_plain_reference(&interp.expr) {
                    return Err(SpecError::at(
                        line,
                        format!(
                            "{what}: expressions are not supported in interpolations; \
                             only ${{NAME}} references to the task environment are"
                        ),
                    ));
                }
                let text = interp.span().and_then(|r| src.text.get(r)).ok_or_else(|| {
                    SpecError::at(line, format!("{what}: interpolation without a position"))
                })?;
                out.push_str(text);
            }
            Element::Directive(d) => {
                return Err(SpecError::at(
                    src.line_of(d.as_ref()),
                    format!("{what}: template directives (%{{...}}) are not supported"),
                ))
            }
        }
    }
    Ok(out)
}

/// The NAME of a `var.NAME` reference.
pub(crate) fn variable_reference(expr: &Expression) -> Option<&str> {
    let Expression::Traversal(t) = expr else {
        return None;
    };
    let Expression::Variable(root) = &t.expr else {
        return None;
    };
    match t.operators.as_slice() {
        [op] if root.as_str() == "var" => match op.value() {
            TraversalOperator::GetAttr(name) => Some(name.as_str()),
            _ => None,
        },
        _ => None,
    }
}

/// A reference to a variable the file does not declare.
fn undeclared(src: &Source<'_>, expr: &Expression, name: &str, what: &str) -> SpecError {
    SpecError::at(
        src.line_of(expr),
        format!(
            "{what}: var.{name} refers to an undeclared variable: declare it with \
             `variable {name:?} {{ ... }}`"
        ),
    )
}

/// `NAME` or `a.b.c`: references berth may resolve at run time.
fn is_plain_reference(expr: &Expression) -> bool {
    match expr {
        Expression::Variable(_) => true,
        Expression::Traversal(t) => {
            matches!(t.expr, Expression::Variable(_))
                && t.operators
                    .iter()
                    .all(|op| matches!(op.value(), TraversalOperator::GetAttr(_)))
        }
        _ => false,
    }
}
