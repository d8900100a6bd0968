//! Input variables of a job file, Nomad's HCL2 way in a small form:
//!
//! ```hcl
//! variable "image_tag" {
//!   type        = string   # string (the default), number or bool
//!   default     = "1.2"
//!   description = "..."
//! }
//! ```
//!
//! `var.image_tag` as a whole value and `${var.image_tag}` inside strings
//! take the variable's value; `-var image_tag=1.3` (the caller's overrides)
//! wins over the default. A variable without a default must be given; an
//! override of a variable the file does not declare, a reference to one,
//! or a value of the wrong type is an error that names it.

use std::collections::BTreeMap;

use hcl_edit::expr::Expression;
use hcl_edit::structure::{Block, Body, Structure};
use hcl_edit::Number;

use super::hcl::Source;
use super::SpecError;

/// The type of a variable.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum VarType {
    String,
    Number,
    Bool,
}

impl VarType {
    fn name(self) -> &'static str {
        match self {
            VarType::String => "string",
            VarType::Number => "number",
            VarType::Bool => "bool",
        }
    }

    /// Whether `expr` (a literal) is a value of this type.
    fn holds(self, expr: &Expression) -> bool {
        match self {
            VarType::String => matches!(expr, Expression::String(_)),
            VarType::Number => matches!(expr, Expression::Number(_)),
            VarType::Bool => matches!(expr, Expression::Bool(_)),
        }
    }

    /// A value given on the command line, as this type.
    fn parse(self, text: &str) -> Option<Expression> {
        match self {
            VarType::String => Some(Expression::from(text)),
            VarType::Bool => match text {
                "true" => Some(Expression::from(true)),
                "false" => Some(Expression::from(false)),
                _ => None,
            },
            VarType::Number => {
                let t = text.trim();
                if let Ok(u) = t.parse::<u64>() {
                    return Some(Expression::from(u));
                }
                if let Ok(i) = t.parse::<i64>() {
                    return Some(Expression::from(i));
                }
                t.parse::<f64>()
                    .ok()
                    .filter(|f| f.is_finite())
                    .and_then(Number::from_f64)
                    .map(Expression::from)
            }
        }
    }
}

/// A declared variable: its line, type and default.
struct Declared {
    line: usize,
    var_type: VarType,
    default: Option<Expression>,
}

/// The values of the file's variables: each declared one's override or
/// default. `overrides` are `-var NAME=VALUE` pairs, later ones winning.
pub(super) fn decode_variables(
    src: &Source<'_>,
    body: &Body,
    overrides: &[(String, String)],
) -> Result<BTreeMap<String, Expression>, SpecError> {
    let mut declared: BTreeMap<String, Declared> = BTreeMap::new();
    for block in body.blocks().filter(|b| b.has_ident("variable")) {
        let (name, var) = decode_variable(src, block)?;
        if let Some(first) = declared.get(&name) {
            return Err(SpecError::at(
                var.line,
                format!(
                    "variable {name:?} is declared twice (first on line {})",
                    first.line
                ),
            ));
        }
        declared.insert(name, var);
    }

    let mut given: BTreeMap<&str, &str> = BTreeMap::new();
    for (name, value) in overrides {
        if !declared.contains_key(name) {
            let known = if declared.is_empty() {
                "the job file declares no variables".to_string()
            } else {
                format!(
                    "the job file declares {}",
                    declared
                        .keys()
                        .map(|k| format!("{k:?}"))
                        .collect::<Vec<_>>()
                        .join(", ")
                )
            };
            return Err(SpecError::without_line(format!(
                "-var {name}=...: no variable {name:?} is declared ({known})"
            )));
        }
        given.insert(name, value);
    }

    let mut values = BTreeMap::new();
    for (name, var) in declared {
        let value = match given.get(name.as_str()) {
            Some(text) => var.var_type.parse(text).ok_or_else(|| {
                SpecError::without_line(format!(
                    "-var {name}={text}: variable {name:?} is a {}",
                    var.var_type.name()
                ))
            })?,
            None => var.default.ok_or_else(|| {
                SpecError::at(
                    var.line,
                    format!(
                        "variable {name:?} has no default: give it a value with -var {name}=..."
                    ),
                )
            })?,
        };
        values.insert(name, value);
    }
    Ok(values)
}

fn decode_variable(src: &Source<'_>, block: &Block) -> Result<(String, Declared), SpecError> {
    let line = src.line_of(block);
    let name = match block.labels.as_slice() {
        [label] => label.as_str().to_string(),
        _ => {
            return Err(SpecError::at(
                line,
                format!(
                    "block \"variable\" needs exactly one label, the variable name (found {})",
                    block.labels.len()
                ),
            ))
        }
    };
    let ctx = format!("variable {name:?}");
    if name.is_empty()
        || !name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-')
        || name.starts_with(|c: char| c.is_ascii_digit())
    {
        return Err(SpecError::at(
            line,
            format!(
                "{ctx}: a variable name is letters, digits, _ and - (not starting with a digit)"
            ),
        ));
    }
    let mut var_type = None;
    let mut default = None;
    for s in block.body.iter() {
        match s {
            Structure::Attribute(a) => {
                let at = src.line_of(&a.value);
                match a.key.as_str() {
                    "type" => var_type = Some(decode_type(&a.value, at, &ctx)?),
                    "default" => default = Some(decode_literal(&a.value, at, &ctx)?),
                    "description" => {
                        if !matches!(a.value, Expression::String(_)) {
                            return Err(SpecError::at(
                                at,
                                format!("attribute \"description\" in {ctx}: expected a string"),
                            ));
                        }
                    }
                    other => {
                        return Err(SpecError::at(
                            src.line_of(a),
                            format!("unknown attribute {other:?} in {ctx}"),
                        ))
                    }
                }
            }
            Structure::Block(b) => {
                return Err(SpecError::at(
                    src.line_of(b),
                    format!("unsupported block {:?} in {ctx}", b.ident.as_str()),
                ))
            }
        }
    }
    let var_type = match (var_type, &default) {
        (Some(t), _) => t,
        (None, Some(Expression::Number(_))) => VarType::Number,
        (None, Some(Expression::Bool(_))) => VarType::Bool,
        (None, _) => VarType::String,
    };
    if let Some(d) = &default {
        if !var_type.holds(d) {
            return Err(SpecError::at(
                src.line_of(d),
                format!(
                    "attribute \"default\" in {ctx}: the variable is a {}, the default is not",
                    var_type.name()
                ),
            ));
        }
    }
    Ok((
        name,
        Declared {
            line,
            var_type,
            default,
        },
    ))
}

/// `string`, `number` or `bool` (also accepted quoted).
fn decode_type(expr: &Expression, line: usize, ctx: &str) -> Result<VarType, SpecError> {
    let name = match expr {
        Expression::Variable(v) => v.as_str().to_string(),
        Expression::String(s) => s.value().clone(),
        _ => String::new(),
    };
    match name.as_str() {
        "string" => Ok(VarType::String),
        "number" => Ok(VarType::Number),
        "bool" => Ok(VarType::Bool),
        _ => Err(SpecError::at(
            line,
            format!(
                "attribute \"type\" in {ctx}: berth supports the types string, number and bool"
            ),
        )),
    }
}

/// A default: a string without interpolations, a number or a bool.
fn decode_literal(expr: &Expression, line: usize, ctx: &str) -> Result<Expression, SpecError> {
    match expr {
        Expression::String(_) | Expression::Number(_) | Expression::Bool(_) => Ok(expr.clone()),
        Expression::UnaryOp(_) => {
            // A negative number: `-1`.
            let text = expr.to_string();
            VarType::Number.parse(text.trim()).ok_or_else(|| {
                SpecError::at(
                    line,
                    format!("attribute \"default\" in {ctx}: expected a literal value"),
                )
            })
        }
        _ => Err(SpecError::at(
            line,
            format!(
                "attribute \"default\" in {ctx}: expected a literal string, number or bool \
                 (defaults cannot refer to anything)"
            ),
        )),
    }
}
